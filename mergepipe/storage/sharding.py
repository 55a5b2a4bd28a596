"""Which weight files a written checkpoint has, and which tensors each holds.

A merged snapshot either mirrors its base's files (same names, same tensors
in each, same header metadata) or is cut into Hugging Face-style shards of
at most ``max_bytes`` of tensor data (``merge --out-shard-size``).

``pack_shards`` follows the convention of ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` (which transformers' ``save_pretrained``
uses): tensors are taken in order and a shard is closed when the next tensor
would take it over the limit; a tensor larger than the limit sits alone in
its shard (the only way a shard exceeds the limit). Nothing is reordered to
fill shards better. Where no tensor exceeds the limit the shards are
``huggingface_hub``'s exactly; an oversized tensor is where they differ:
``huggingface_hub`` lists its shard first and goes on filling the shard it
interrupted, here it keeps its place and the next tensor starts a new shard
(as transformers' former ``shard_checkpoint`` did), so the shards read in
order hold the tensors in the base's order.

Names are Hugging Face's: one shard is ``model.safetensors`` without an
index (as transformers writes it); N > 1 shards are
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from mergepipe.storage.checkpoint import SINGLE_FILE, Checkpoint


@dataclass(frozen=True)
class OutputFile:
    """One weight file to write: its name in the output folder, its tensors in data order, and the
    ``__metadata__`` of its safetensors header."""

    name: str
    tensors: tuple[str, ...]
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class OutputLayout:
    """The weight files of an output, in order, and whether ``model.safetensors.index.json`` lists them."""

    files: tuple[OutputFile, ...]
    indexed: bool

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it, sorted by tensor name (as transformers writes its index)."""
        return dict(sorted((tensor, f.name) for f in self.files for tensor in f.tensors))


def mirror_layout(checkpoint: Checkpoint) -> OutputLayout:
    """The layout of ``checkpoint`` itself: its files, tensors and metadata, indexed when it is."""
    files = tuple(OutputFile(f.name, tuple(f.header.tensors), f.header.metadata) for f in checkpoint.files)
    return OutputLayout(files, checkpoint.index is not None)


def pack_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """``(tensor name, bytes)`` in order, cut greedily into shards of at most ``max_bytes`` each (a
    tensor larger than that alone in its shard); at least one shard, empty when there are no tensors."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
    shards: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in sizes:
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += nbytes
    return shards


def shard_name(number: int, count: int) -> str:
    """The file name of shard ``number`` (1-based) of ``count``: Hugging Face's five-digit pattern."""
    if count == 1:
        return SINGLE_FILE
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def packed_layout(sizes: Sequence[tuple[str, int]], max_bytes: int,
                  metadata: dict[str, str] | None = None) -> OutputLayout:
    """Shards of at most ``max_bytes`` of tensor data (``pack_shards``), each with header ``metadata``;
    indexed when there is more than one."""
    shards = pack_shards(sizes, max_bytes)
    files = tuple(OutputFile(shard_name(i + 1, len(shards)), tuple(names), metadata)
                  for i, names in enumerate(shards))
    return OutputLayout(files, len(files) > 1)


def index_text(layout: OutputLayout, total_size: int) -> str:
    """The text of ``model.safetensors.index.json``: ``metadata.total_size`` (bytes of tensor data) and
    the weight map."""
    index = {"metadata": {"total_size": total_size}, "weight_map": layout.weight_map()}
    return json.dumps(index, indent=2) + "\n"
