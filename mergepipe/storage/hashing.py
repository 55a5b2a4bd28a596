"""Content hashes: blake3 of a block, and the blake3 of a whole file as it is written.

``block_digest`` is one definition for analysis (which records every block's
hash) and the engine (which checks every block it reads against the record
before using it). Single-threaded blake3 runs at several GB/s per core, above
what the statistics and merges around it sustain.

``FileHash`` is the manifest's file hash, computed from the bytes as the
engine produces them, so sealing a snapshot needs no second pass over a
multi-GB output. It is blake3, the ``b3sum`` of the file: several times
faster than sha256 on one core, which matters because a merge is CPU-bound
and hashes every byte it writes. Manifests of schema 1
recorded sha256; ``file_digest`` computes either, so ``verify`` still checks
them. A file hash is sequential while work units write at fixed
offsets, possibly out of order and on several threads: a piece that arrives
at the next offset is hashed at once from the caller's buffer (with whatever
was waiting behind it); a piece further on waits as a copy while the waiting
copies stay within ``reorder_bytes``, else only as its place in the file,
read back when its turn comes (it was written before it was added, and was
just written, so the read comes from the page cache). The digest is exactly
the hash of the file: every byte goes in once, in file order.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import blake3

#: Out-of-order bytes one file's hash keeps in memory while earlier bytes are still being made: enough for a
#: few blocks from each concurrent unit; beyond it only their places are kept and the bytes are read back.
REORDER_BYTES = 64 * 1024 * 1024
#: Bytes read back per positional read when hashing from the file.
READ_BACK_BYTES = 8 * 1024 * 1024
#: The file hash ``FileHash`` computes and new manifests record (since manifest schema 2).
FILE_HASH = "blake3"
#: The file hashes a manifest can record: ``FILE_HASH``, and sha256 before schema 2.
FILE_HASHES = (FILE_HASH, "sha256")

Buffer = bytes | bytearray | memoryview


def block_digest(data: bytes | bytearray | memoryview) -> str:
    """blake3 hex digest of ``data``."""
    return blake3.blake3(data).hexdigest()


def file_digest(path: str | os.PathLike[str] | int, algorithm: str = FILE_HASH) -> str:
    """Hex digest (``algorithm``: one of ``FILE_HASHES``) of the file at ``path``, or open as the descriptor
    ``path`` (closed after), read in large pieces."""
    if algorithm not in FILE_HASHES:
        raise ValueError(f"unknown file hash {algorithm!r}; known: {', '.join(FILE_HASHES)}")
    h = blake3.blake3() if algorithm == FILE_HASH else hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(READ_BACK_BYTES):
            h.update(piece)
    return h.hexdigest()


class FileHash:
    """The blake3 of the ``size``-byte file at ``path``, fed with its bytes as they are written.

    ``add(offset, data)`` after ``data`` is in the file at ``offset`` (or ``add(offset, length=n)`` for bytes
    that are only in the file, such as a header written elsewhere). Safe from any number of threads; every
    byte must be added exactly once (``ShardWriter`` guarantees it for the data, the caller for the header).
    Only one thread hashes at a time, in file order; the others leave their pieces and go on.
    """

    def __init__(self, path: str | os.PathLike[str], size: int, reorder_bytes: int = REORDER_BYTES) -> None:
        self.path = Path(path)
        self.size = size
        self.reorder_bytes = reorder_bytes
        self._hash = blake3.blake3()
        self._lock = threading.Lock()
        self._next = 0  # every byte before it is hashed
        self._hashing = False  # a thread is feeding the hash (outside the lock)
        self._waiting: dict[int, tuple[int, bytes | None]] = {}  # offset -> (length, copy or None: in the file)
        self._held = 0  # bytes of the copies in _waiting
        self._read_backs = 0
        self._failed = False  # hashing raised part-way: the digest is unusable

    @property
    def hashed_bytes(self) -> int:
        """Bytes hashed so far (a prefix of the file)."""
        with self._lock:
            return self._next

    @property
    def read_back_bytes(self) -> int:
        """Bytes hashed from the file rather than from the writer's buffers."""
        with self._lock:
            return self._read_backs

    def add(self, offset: int, data: Buffer | None = None, length: int | None = None) -> None:
        """Bytes ``[offset, offset + len)`` are in the file: ``data`` when given, else ``length`` bytes
        there. Hashed now if they come next, else kept (a copy, or their place) until their turn."""
        view = None if data is None else memoryview(data).cast("B")
        n = len(view) if view is not None else length
        if n is None or n < 0 or (view is not None and length not in (None, n)):
            raise ValueError(f"{self.path}: add() needs data or a length, not both")
        if n == 0:
            return
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + n}) lie outside the {self.size}-byte file")
        with self._lock:
            if offset < self._next or offset in self._waiting:
                raise ValueError(f"{self.path}: bytes at {offset} were added twice")
            if self._hashing or offset != self._next:  # not our turn: leave the piece for the one hashing
                kept = bytes(view) if view is not None and self._held + n <= self.reorder_bytes else None
                self._waiting[offset] = (n, kept)
                self._held += n if kept is not None else 0
                return
            self._hashing = True
        self._hash_in_turn(offset, n, view)

    def hexdigest(self) -> str:
        """The file's blake3; ValueError if some of its bytes were never added."""
        with self._lock:
            if self._failed:
                raise ValueError(f"{self.path}: hashing failed part-way, so there is no digest")
            if self._hashing or self._next != self.size:
                waiting = ", ".join(str(o) for o in sorted(self._waiting)[:3])
                raise ValueError(f"{self.path}: hashed {self._next} of {self.size} bytes (pieces waiting at: "
                                 f"{waiting or 'none'})")
            return self._hash.hexdigest()

    def _hash_in_turn(self, offset: int, n: int, view: memoryview | None) -> None:
        """Hash the piece at ``offset`` (the next one), then every waiting piece that follows it."""
        try:
            while True:
                if view is not None:
                    self._hash.update(view)
                else:
                    self._read_back(offset, n)
                with self._lock:
                    self._next = offset = offset + n
                    waiting = self._waiting.pop(offset, None)
                    if waiting is None:
                        self._hashing = False
                        return
                    n, copy = waiting
                    self._held -= len(copy) if copy is not None else 0
                view = None if copy is None else memoryview(copy)
        except BaseException:
            with self._lock:
                self._hashing, self._failed = False, True  # hexdigest() refuses it
            raise

    def _read_back(self, offset: int, n: int) -> None:
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            end = offset + n
            while offset < end:
                chunk = os.pread(fd, min(READ_BACK_BYTES, end - offset), offset)
                if not chunk:
                    raise ValueError(f"{self.path}: ends at {offset}, before bytes the writer reported written")
                self._hash.update(chunk)
                offset += len(chunk)
        finally:
            os.close(fd)
        with self._lock:
            self._read_backs += n
