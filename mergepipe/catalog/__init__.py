"""The catalog: the one place with SQL. It stores records and returns them; it never reads checkpoints."""

from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES, Catalog

__all__ = ["DEFAULT_BLOCK_BYTES", "Catalog"]
