"""Atomic publishing (stage, fsync, rename, fsync parent, commit), recovery, verification."""

from mergepipe.txn.fsync import (
    fsync_dir,
    fsync_file,
    fsync_tree,
    make_read_only,
    make_writable_tree,
    remove_tree,
    rename_no_replace,
    sha256_file,
)
from mergepipe.txn.publish import STEPS, StagingArea, TransactionManager, parse_staging_name, staging_path_for
from mergepipe.txn.recover import RecoverReport, recover
from mergepipe.txn.verify import VerifyReport, file_entries, verify_or_raise, verify_snapshot

__all__ = [
    "STEPS",
    "RecoverReport",
    "StagingArea",
    "TransactionManager",
    "VerifyReport",
    "file_entries",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "make_read_only",
    "make_writable_tree",
    "parse_staging_name",
    "recover",
    "remove_tree",
    "rename_no_replace",
    "sha256_file",
    "staging_path_for",
    "verify_or_raise",
    "verify_snapshot",
]
