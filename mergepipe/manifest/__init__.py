"""The manifest: the sealed record of a snapshot and the files it determines (``manifest.py``)."""
