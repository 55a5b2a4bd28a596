"""The catalog: SQLite record of models, blocks, delta statistics, plans and snapshots.

``Catalog`` (db.py) owns the connection and every SQL statement;
``register_model`` (register.py) records a checkpoint from its headers;
``analyze.analyze`` computes block hashes and (expert, base) delta
statistics once. (``analyze`` is not re-exported here: the name would hide
the module of the same name.)
"""

from mergepipe.catalog.db import DEFAULT_BLOCK_BYTES, Catalog
from mergepipe.catalog.register import register_model

__all__ = ["DEFAULT_BLOCK_BYTES", "Catalog", "register_model"]
