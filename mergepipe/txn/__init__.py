"""Atomic publishing (stage, fsync, rename, fsync parent, commit), recovery
after a crash, and verification of published snapshots."""
