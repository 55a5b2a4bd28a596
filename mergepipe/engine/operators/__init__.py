"""Merge kernels: the math of each operator, one module per family.

A kernel is a pure function over fp32 tensors (``context.py`` says what it
is given); ``registry.merge`` is the checked entry point the engine calls.
What an operator *is* (parameters, streaming, error bound) is declared in
``mergepipe.spec.operators``, which the planner reads too.
"""
