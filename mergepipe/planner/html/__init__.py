"""Self-contained HTML reports of an explanation or a snapshot diff.

Pure functions from the planner's dataclasses to one HTML string (inline CSS
and SVG, no script, no network: a Content-Security-Policy forbids any fetch),
so a report can be mailed, archived or opened offline and shows what the
terminal tables show, as pictures (``txn/outpath.write_report`` writes one
atomically). Nothing here imports torch: ``explain --html`` stays fast.
"""
