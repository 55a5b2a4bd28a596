"""Benchmarks: MergePipe vs a naive full-read merge vs mergekit.

Plain scripts, each runnable as ``python -m benchmarks.<name>``. They use the
``mergepipe`` package only through its command line, so they measure it
rather than share code with it.
"""
