"""The engine: executes a plan as a bounded-memory stream of work units,
then seals and publishes the snapshot (``engine.py`` reads top-down)."""
