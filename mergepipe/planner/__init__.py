"""The planner: decides what a merge reads under a budget, from the catalog alone."""
