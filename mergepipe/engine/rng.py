"""Random numbers addressed by element position, for the random operators.

DARE and DELLA drop delta entries at random. MergePipe applies them block by
block, in any thread, with experts in any order, and the result must not
depend on any of that: the same merge with another ``--block-bytes`` must drop
exactly the same entries. So element ``j`` of tensor ``T`` of expert ``E``
gets its number as a pure function of ``(seed, E, T, j)``, from a
counter-based generator, never from a global stream. ``E`` is the expert's
family (``math`` for ``math@2``, ``spec/refs.py``): a retrained version
draws the same numbers for its unchanged tensors, so their merged blocks
stay what they were and an incremental merge can reuse them.

Construction: numpy's ``Philox`` (Philox-4x64-10, a counter-based bit
generator whose raw stream numpy guarantees across versions and platforms)
keyed by the first 128 bits of ``sha256(json([seed, expert_id, tensor_name]))``.
Each counter value yields four 64-bit words, so element ``j`` is raw word
``j`` of that keyed stream: the generator starts at counter ``j // 4`` and
discards ``j % 4`` words. A raw word ``w`` becomes the uniform
``(w >> 11) * 2**-53`` in [0, 1): 53 random bits, exactly a float64.

The stream is generated on the CPU (numpy) and copied to the caller's
device, so the numbers are the same on every machine and device.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch
from numpy.random import Philox

#: Philox-4x64 produces this many 64-bit words per counter increment.
_WORDS_PER_COUNTER = 4
#: A uniform carries 53 random bits: the mantissa of a float64.
_BITS = 53
_MASK53 = (1 << _BITS) - 1
_SCALE = 2.0**-_BITS


def stream_key(seed: int, expert_id: str, tensor_name: str) -> int:
    """The 128-bit Philox key of one (seed, expert, tensor) stream."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    blob = json.dumps([seed, str(expert_id), str(tensor_name)], ensure_ascii=True).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:16], "little")


class ElementRng:
    """Uniform numbers for the elements of one tensor of one expert.

    ``uniform(j0, n)[i]`` is the number of element ``j0 + i``; any split of a
    range into sub-ranges gives the same numbers.
    """

    def __init__(self, seed: int, expert_id: str, tensor_name: str) -> None:
        self.seed = seed
        self.expert_id = expert_id
        self.tensor_name = tensor_name
        self._key = stream_key(seed, expert_id, tensor_name)

    def __repr__(self) -> str:
        return f"ElementRng(seed={self.seed}, expert_id={self.expert_id!r}, tensor_name={self.tensor_name!r})"

    def bits(self, flat_start: int, count: int, device: torch.device | str | None = None) -> torch.Tensor:
        """53 random bits per element as int64 in [0, 2**53), elements
        ``flat_start .. flat_start + count - 1``, on ``device`` (default CPU)."""
        if flat_start < 0 or count < 0:
            raise ValueError(f"invalid element range start={flat_start} count={count}")
        if count == 0:
            return torch.zeros(0, dtype=torch.int64, device=device)
        counter, skip = divmod(flat_start, _WORDS_PER_COUNTER)
        words = Philox(key=self._key, counter=counter).random_raw(skip + count)[skip:]
        raw = torch.from_numpy(np.ascontiguousarray(words).view(np.int64)).to(device)
        # int64 shifts are arithmetic; masking the top bits makes it logical.
        return (raw >> (64 - _BITS)) & _MASK53

    def uniform(self, flat_start: int, count: int) -> torch.Tensor:
        """float64 uniforms in [0, 1) for elements ``flat_start ..``."""
        return self.bits(flat_start, count).to(torch.float64) * _SCALE

    def below(
        self, flat_start: int, count: int, probability: float, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Bool mask ``uniform(flat_start, count) < probability``, without
        building the float64 uniforms (an integer compare, same result)."""
        if probability >= 1.0:
            return torch.ones(count, dtype=torch.bool, device=device)
        if probability <= 0.0:
            return torch.zeros(count, dtype=torch.bool, device=device)
        # u = m * 2**-53 < p  <=>  m < p * 2**53 (exact)  <=>  m < ceil(p * 2**53)
        limit = math.ceil(math.ldexp(probability, _BITS))
        return self.bits(flat_start, count, device) < limit
