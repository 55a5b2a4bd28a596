"""Publishing (stage, fsync, rename, commit; and to the Hub), recovery after a crash, verification."""
