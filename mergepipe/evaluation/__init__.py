"""What a model scores on held-out data (``data.py``, ``loss.py``) and on lm-evaluation-harness tasks
(``harness.py``), knowing nothing of the catalog: the application layer (``app/evaluating.py``) says what is
evaluated and keeps the results."""
