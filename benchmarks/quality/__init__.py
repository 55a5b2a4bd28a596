"""The real-model quality benchmark (see __main__.py)."""
