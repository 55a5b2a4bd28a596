"""The catalog: the one place with SQL. It stores records and returns them;
it never reads checkpoints (``mergepipe.analysis`` does). See ``catalog.py``
for how its stores are composed and ``dialect.py`` for what a second
database backend would replace.
"""

from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES, Catalog

__all__ = ["DEFAULT_BLOCK_BYTES", "Catalog"]
