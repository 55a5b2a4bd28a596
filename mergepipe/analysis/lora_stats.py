"""Delta statistics of a LoRA adapter's tensor, for analysis: ΔW = s·B·A decoded in fp32 from its
factors' span (the catalog rows of an adapter are ``lora_expert.py``'s; kept apart so that registering
an adapter, which planning a merge may do, does not load torch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mergepipe.analysis.stats import TensorResult, from_delta
from mergepipe.catalog.records import BlockRecord, TensorRecord
from mergepipe.storage.convert import to_float32
from mergepipe.storage.lora import LoraTarget
from mergepipe.storage.lora_delta import delta_rows


def decode_span(target: LoraTarget, view: memoryview, span_begin: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole fp32 ΔW of a target from its factors' span, with fp32 A and B."""
    a32 = to_float32(view[target.a.begin - span_begin : target.a.end - span_begin], target.a.dtype,
                     tuple(target.a.shape))
    b32 = to_float32(view[target.b.begin - span_begin : target.b.end - span_begin], target.b.dtype,
                     tuple(target.b.shape))
    return delta_rows(b32, a32, target.scale, target.transposed), a32, b32


def span_result(target: LoraTarget, view: memoryview, t: TensorRecord, blocks: Sequence[BlockRecord],
                who: str) -> TensorResult:
    """Per-block statistics and trim thresholds of ΔW (this tensor only, in fp32); a block is unchanged when
    its B rows are all zero."""
    rows = target.shape[0]
    delta, a32, b32 = decode_span(target, view, t.begin)
    if target.transposed:  # row i of ΔW is column i of A (times B)
        flags = [bool((a32[:, b.row_start : b.row_end] == 0).all()) for b in blocks]
    else:
        flags = [bool((b32[b.row_start : b.row_end] == 0).all()) for b in blocks]
    # from_delta sizes blocks by bytes: describe ΔW as the F32 tensor it is
    row = 4 * target.shape[1]
    as_f32 = TensorRecord(t.name, t.file, "F32", t.shape, 0, rows * row, t.ordinal)
    f32_blocks = [BlockRecord(t.name, b.index, b.row_start, b.row_end, b.row_start * row, b.row_end * row, b.hash)
                  for b in blocks]
    return from_delta(as_f32, f32_blocks, flags, delta.abs_().reshape(-1), who)
