"""Four offline corpora with disjoint train and held-out parts.

* ``py``: Python standard-library source;
* ``prose``: English manual pages (section 1), roff markup stripped;
* ``arith``: generated integer arithmetic ("417 + 238 = 655");
* ``c``: C headers from the system include directory.

Files are split by a hash of their path (about one in eight held out), so the
held-out text is never seen in training; arithmetic uses two seeds. Every
choice is deterministic: the same machine gives the same corpora.
"""

from __future__ import annotations

import gzip
import hashlib
import random
import re
import sysconfig
from pathlib import Path

NAMES = ("py", "prose", "arith", "c")
#: Cap per split, characters: plenty for a few dozen training steps and evaluation.
MAX_CHARS = 4_000_000
_ROFF_ESCAPE = re.compile(r"\\f[A-Z0-9]|\\f\(..|\\\(..|\\[&|^/,]|\\-")


def _held_out(path: Path) -> bool:
    return hashlib.sha256(str(path).encode()).digest()[0] % 8 == 0


def _collect(paths: list[Path], read) -> tuple[str, str]:
    train, held = [], []
    sizes = [0, 0]
    for path in sorted(paths):
        part = 1 if _held_out(path) else 0
        if sizes[part] >= MAX_CHARS:
            continue
        try:
            text = read(path)
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            (held if part else train).append(text)
            sizes[part] += len(text)
    return "\n".join(train), "\n".join(held)


def _man_text(path: Path) -> str:
    lines = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        text = handle.read()
    for line in text.splitlines():
        if line.startswith((".", "'")):
            continue  # roff requests and comments
        lines.append(_ROFF_ESCAPE.sub(lambda m: "-" if m.group(0) == "\\-" else "", line))
    return "\n".join(lines)


def _arith(seed: int, n: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(f"{a} {op} {b} = {value}")
    return "\n".join(out)


def build(name: str) -> tuple[str, str]:
    """``(train text, held-out text)`` of corpus ``name``."""
    if name == "py":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts]
        return _collect(files, lambda p: p.read_text(encoding="utf-8"))
    if name == "prose":
        return _collect(list(Path("/usr/share/man/man1").glob("*.1.gz")), _man_text)
    if name == "arith":
        return _arith(1, 120_000), _arith(2, 20_000)
    if name == "c":
        return _collect(list(Path("/usr/include").rglob("*.h")), lambda p: p.read_text(encoding="utf-8"))
    raise ValueError(f"unknown corpus {name!r}; known: {', '.join(NAMES)}")
