"""Safetensors bytes: headers, checkpoint directories, block geometry, exact
range reads (``RangeSource``), read-ahead, conversion and streaming writes.

No SQL and no merging here. Modules are imported by name (no re-exports), so
importing one does not load the others.
"""
