"""MergePipe: budget-aware parameter management for LLM merging.

The loop is register -> analyze -> plan(budget) -> execute -> publish ->
verify / explain / lineage. See docs/ARCHITECTURE.md for the map.
"""

__version__ = "0.1.0"
