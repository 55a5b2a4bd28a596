"""Merge operators, one module per method family, listed in ``registry.py``.

The engine is the only importer: ``get_operator(name)`` gives an ``Operator``
(see ``base.py`` for the interface and the error bounds each one allows).
"""
