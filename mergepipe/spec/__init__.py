"""What a merge is: the bottom layer that the planner and the engine share.

Pure Python (no torch, no I/O): the parameter catalogue and the setting
language, each operator's definition (parameters, streaming, error bound),
the ``MergeSpec`` a user writes, the trim-threshold contract, and the
``Plan`` with its canonical JSON and strict reader.
"""
