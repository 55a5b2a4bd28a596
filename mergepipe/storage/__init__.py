"""Checkpoint bytes: headers, checkpoint directories local and remote, exact counted range reads, read-ahead,
hashing, LoRA adapters, delta store encodings and streaming writes. No SQL, no merging; no re-exports."""
