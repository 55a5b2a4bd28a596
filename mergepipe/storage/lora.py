"""A PEFT LoRA adapter directory as exact, row-addressable deltas of its base's tensors.

**Files.** ``adapter_config.json`` (read by ``storage/lora_config.py``, which
also states the scale rule and the config-level refusals) and
``adapter_model.safetensors``. Opening reads the config and the safetensors
*header* only (``format.read_header``): no tensor data, so registering an
adapter costs no factor bytes. An adapter saved only as
``adapter_model.bin`` (pickle) is refused: convert it to safetensors.

**Keys.** ``save_pretrained`` strips the adapter name, so keys are
``base_model.model.<module>.<rest>``:

- ``<module>.lora_A.weight`` (r, in) and ``<module>.lora_B.weight`` (out, r):
  LoRA on the base tensor ``<module>.weight``, ΔW = s·B·A of shape (out, in);
  with ``fan_in_fan_out`` (GPT-2's ``Conv1D`` stores its weight (in, out))
  ΔW = s·(B·A)ᵀ of shape (in, out).
- ``<module>.lora_embedding_A`` (r, num_embeddings) and
  ``<module>.lora_embedding_B`` (dim, r): LoRA on an embedding, whose weight
  is (num_embeddings, dim), so always ΔW = s·(B·A)ᵀ, as PEFT merges it.
- any other key is a full replacement of the base tensor of the same name,
  because PEFT's loader copies it over the base: ``modules_to_save``
  modules (``<module>.weight``) and the copy of a LoRA-targeted embedding
  PEFT saves beside its factors (``<module>.base_layer.weight``). The
  expert's tensor is then ``saved + ΔW`` (ΔW = 0 without factors), so its
  Δ = (saved − base) + ΔW; tensors the adapter does not name have Δ = 0.

s and the rank come from the config per module (rank_pattern /
alpha_pattern; s = α/r, or α/√r with rsLoRA), and the factors must have
exactly that rank, as PEFT's loader requires. Whether a linear ΔW is
transposed is the config's ``fan_in_fan_out``, which PEFT itself sets from
the targeted layers' type (``Conv1D``) before saving; a model mixing
``Linear`` and ``Conv1D`` targets is refused by the shape check, except
where a square weight of the other type cannot be told apart by shape.

**Reading.** ``storage/lora_delta.py`` reads ΔW by row blocks and says
which factor bytes each block costs (what the budget counts).

**Refused**, each in one line naming the key or field and what to do
(``CheckpointError``; malformed files ``CorruptCheckpointError``): a key
outside ``base_model.model.``; a key that maps to no base tensor; a LoRA
module that ``target_modules`` does not select (PEFT would ignore its
factors); a factor without its partner; factor shapes that do not fit the
module's rank or the base tensor's shape (transposed with
``fan_in_fan_out``); DoRA magnitudes (``lora_magnitude_vector``) and other
``lora_*`` tensors (``lora_B.bias``, an adapter-name segment); quantized or
other non-float factors (F32, F16 and BF16 only); a replacement whose shape
differs from the base's (a resized vocabulary); a non-float base tensor
under LoRA; an adapter with no tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.format import SafetensorsHeader, TensorEntry, read_header
from mergepipe.storage.lora_config import MERGE_FIRST, AdapterConfig, read_adapter_config

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_BIN_FILE = "adapter_model.bin"
KEY_PREFIX = "base_model.model."
BASE_LAYER = "base_layer"
# (key suffix, factor, embedding?)
_FACTOR_SUFFIXES = (
    (".lora_A.weight", "A", False),
    (".lora_B.weight", "B", False),
    (".lora_embedding_A", "A", True),
    (".lora_embedding_B", "B", True),
)
# The float dtypes storage/convert.py merges (named here so that opening an adapter needs no torch).
FACTOR_DTYPES = frozenset({"F32", "F16", "BF16"})
_FIX = "re-save it with peft's save_pretrained"
_OTHER_BASE = "the adapter was trained on another model; register it against its own base"

# The base's tensors, name -> (safetensors dtype, shape): what the catalog records.
BaseTensors = Mapping[str, tuple[str, tuple[int, ...]]]
ByteRange = tuple[Path, int, int]


@dataclass(frozen=True)
class LoraTarget:
    """LoRA on one base tensor: ΔW = scale·B·A, or scale·(B·A)ᵀ when ``transposed``.

    ``a``/``b`` locate the factors in ``path`` (absolute byte offsets).
    ``transposed`` holds for embeddings and ``fan_in_fan_out`` modules.
    """

    tensor: str
    module: str
    path: Path
    a: TensorEntry
    b: TensorEntry
    rank: int
    alpha: float
    scale: float
    transposed: bool
    embedding: bool

    @property
    def shape(self) -> tuple[int, int]:
        """ΔW's shape: the base tensor's."""
        if self.transposed:
            return (self.a.shape[1], self.b.shape[0])
        return (self.b.shape[0], self.a.shape[1])

    @property
    def factor_bytes(self) -> int:
        """Bytes of both factors: what reading the whole ΔW costs."""
        return self.a.nbytes + self.b.nbytes


@dataclass(frozen=True)
class SavedTensor:
    """A tensor the adapter stores whole; it replaces the base tensor ``tensor``.

    ``origin`` says why PEFT saved it: ``modules_to_save``, ``base_layer``
    (the copy of a LoRA-targeted embedding) or ``saved`` (another saved
    layer, e.g. embeddings written with ``save_embedding_layers``).
    """

    tensor: str
    path: Path
    entry: TensorEntry
    origin: str

    def byte_range(self, row_start: int, row_end: int) -> ByteRange:
        """The bytes of rows [row_start, row_end): one contiguous range."""
        check_rows(self.tensor, self.entry.rows, row_start, row_end)
        row_bytes = self.entry.row_bytes
        return (self.path, self.entry.begin + row_start * row_bytes, self.entry.begin + row_end * row_bytes)


@dataclass(frozen=True)
class LoraAdapter:
    """An opened adapter: ``targets`` and ``saved`` keyed by base tensor name, in the base's order."""

    root: Path
    config: AdapterConfig
    weights: Path
    header: SafetensorsHeader
    targets: dict[str, LoraTarget]
    saved: dict[str, SavedTensor]

    @property
    def factor_bytes(self) -> int:
        """Bytes of every LoRA factor (a full read of every ΔW)."""
        return sum(t.factor_bytes for t in self.targets.values())

    @property
    def saved_bytes(self) -> int:
        """Bytes of every replacement tensor."""
        return sum(s.entry.nbytes for s in self.saved.values())


@dataclass(frozen=True)
class _Key:
    kind: str  # "A", "B" (factors) or "copy", "saved" (replacements)
    module: str
    tensor: str
    embedding: bool = False


def open_lora_adapter(path: str | os.PathLike[str], base_tensors: BaseTensors) -> LoraAdapter:
    """Open the PEFT adapter at ``path`` against its base's tensors, reading headers only."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"no such adapter directory: {root} (give the folder written by peft's save_pretrained)")
    config = read_adapter_config(root)
    weights = _weights_file(root)
    header = read_header(weights)
    factors: dict[str, dict[str, TensorEntry]] = {}
    embedding: dict[str, set[bool]] = {}
    replacements: list[tuple[_Key, TensorEntry]] = []
    for entry in header.tensors.values():
        key = _classify(weights, entry.name)
        if key.kind in ("A", "B"):
            factors.setdefault(key.module, {})[key.kind] = entry
            embedding.setdefault(key.module, set()).add(key.embedding)
        else:
            replacements.append((key, entry))
    if not factors and not replacements:
        raise CheckpointError(f"{weights} holds no tensors; {_FIX}")
    targets = [_target(weights, config, m, parts, embedding[m], base_tensors) for m, parts in factors.items()]
    saved = _saved_tensors(weights, config, replacements, set(factors), base_tensors)
    order = {name: i for i, name in enumerate(base_tensors)}
    return LoraAdapter(
        root=root,
        config=config,
        weights=weights,
        header=header,
        targets={t.tensor: t for t in sorted(targets, key=lambda t: order[t.tensor])},
        saved={s.tensor: s for s in sorted(saved, key=lambda s: order[s.tensor])},
    )


def _weights_file(root: Path) -> Path:
    weights = root / ADAPTER_WEIGHTS_FILE
    if weights.is_file():
        return weights
    if (root / ADAPTER_BIN_FILE).is_file():
        raise CheckpointError(
            f"{root / ADAPTER_BIN_FILE} is a pickled adapter; convert it to safetensors "
            f"(load it with peft and save_pretrained(..., safe_serialization=True)) and register {root} again"
        )
    raise CheckpointError(f"{root} has no {ADAPTER_WEIGHTS_FILE}; give the folder written by peft's save_pretrained")


def _classify(weights: Path, key: str) -> _Key:
    """What an adapter key is and which base tensor it maps to (see the module docstring)."""
    if not key.startswith(KEY_PREFIX):
        raise CheckpointError(f"{weights}: tensor {key!r} does not start with {KEY_PREFIX!r}; {_FIX}")
    rest = key[len(KEY_PREFIX):]
    for suffix, kind, is_embedding in _FACTOR_SUFFIXES:
        if rest.endswith(suffix):
            module = rest[: -len(suffix)]
            return _Key(kind, module, f"{module}.weight", is_embedding)
    segments = rest.split(".")
    if "lora_magnitude_vector" in segments:
        raise CheckpointError(
            f"{weights}: {key!r} is a DoRA magnitude vector; DoRA adapters are not supported: {MERGE_FIRST}"
        )
    if any(segment.startswith("lora_") for segment in segments):
        raise CheckpointError(
            f"{weights}: {key!r} is not a LoRA factor MergePipe reads (lora_A.weight, lora_B.weight, "
            f"lora_embedding_A/B); LoRA biases and other variants are not supported; {_FIX} without them"
        )
    if BASE_LAYER in segments:
        at = segments.index(BASE_LAYER)
        return _Key("copy", ".".join(segments[:at]), ".".join(segments[:at] + segments[at + 1 :]))
    return _Key("saved", rest.rpartition(".")[0], rest)


def _target(
    weights: Path,
    config: AdapterConfig,
    module: str,
    parts: dict[str, TensorEntry],
    kinds: set[bool],
    base_tensors: BaseTensors,
) -> LoraTarget:
    a, b = parts.get("A"), parts.get("B")
    if len(kinds) > 1:
        raise CheckpointError(f"{weights}: module {module!r} mixes lora_A/B and lora_embedding_A/B factors; {_FIX}")
    embedding = kinds == {True}
    if a is None or b is None:
        have, lack = ("A", "B") if b is None else ("B", "A")
        raise CheckpointError(f"{weights}: module {module!r} has a lora_{have} factor but no lora_{lack}; {_FIX}")
    if not config.targets(module):
        raise CheckpointError(
            f"{weights}: module {module!r} has LoRA factors but target_modules {config.target_modules!r} of "
            f"{config.path.name} does not select it, so peft would ignore them; fix the config or {_FIX}"
        )
    tensor = f"{module}.weight"
    if tensor not in base_tensors:
        raise CheckpointError(f"{weights}: LoRA factors of {module!r} have no base tensor {tensor!r}; {_OTHER_BASE}")
    base_dtype, base_shape = base_tensors[tensor]
    if base_dtype not in FACTOR_DTYPES:
        raise CheckpointError(
            f"{weights}: base tensor {tensor!r} is {base_dtype}; LoRA on a quantized base cannot be merged exactly: "
            "register the adapter against the unquantized base"
        )
    for factor in (a, b):
        _check_float(weights, factor)
    rank = config.rank_of(module)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise CheckpointError(
            f"{weights}: factors of {module!r} are A {list(a.shape)}, B {list(b.shape)}, not (rank, n) and "
            f"(m, rank) with the rank {rank} that {config.path.name} gives it (r, rank_pattern); {_FIX}"
        )
    transposed = embedding or config.fan_in_fan_out
    target = LoraTarget(
        tensor=tensor, module=module, path=weights, a=a, b=b, rank=rank, alpha=config.alpha_of(module),
        scale=config.scale_of(module), transposed=transposed, embedding=embedding,
    )
    if target.shape != tuple(base_shape):
        layout = "(B·A)ᵀ" if transposed else "B·A"
        raise CheckpointError(
            f"{weights}: ΔW = {layout} of {module!r} is {list(target.shape)} but base tensor {tensor!r} is "
            f"{list(base_shape)} (fan_in_fan_out={config.fan_in_fan_out}); {_OTHER_BASE}"
        )
    return target


def _saved_tensors(
    weights: Path,
    config: AdapterConfig,
    replacements: list[tuple[_Key, TensorEntry]],
    lora_modules: set[str],
    base_tensors: BaseTensors,
) -> list[SavedTensor]:
    out: dict[str, SavedTensor] = {}
    for key, entry in replacements:
        # PEFT's loader puts base_layer tensors only under LoRA modules, and a LoRA module's own
        # weights only under base_layer: anything else it would silently drop.
        if (key.kind == "copy") != (key.module in lora_modules):
            what = "the base_layer of a module without LoRA factors" if key.kind == "copy" else (
                "a weight of a LoRA module saved outside its base_layer")
            raise CheckpointError(f"{weights}: {entry.name!r} is {what}, which peft would ignore; {_FIX}")
        if key.tensor not in base_tensors:
            raise CheckpointError(f"{weights}: {entry.name!r} maps to no base tensor {key.tensor!r}; {_OTHER_BASE}")
        _check_float(weights, entry)
        base_shape = tuple(base_tensors[key.tensor][1])
        if entry.shape != base_shape:
            raise CheckpointError(
                f"{weights}: saved tensor {entry.name!r} is {list(entry.shape)} but base tensor {key.tensor!r} is "
                f"{list(base_shape)} (a resized vocabulary?); register it against the base it was trained on"
            )
        if key.tensor in out:
            raise CorruptCheckpointError(f"{weights}: two tensors replace base tensor {key.tensor!r}; {_FIX}")
        origin = "base_layer" if key.kind == "copy" else "modules_to_save" if config.saves(key.module) else "saved"
        out[key.tensor] = SavedTensor(tensor=key.tensor, path=weights, entry=entry, origin=origin)
    return list(out.values())


def _check_float(weights: Path, entry: TensorEntry) -> None:
    if entry.dtype not in FACTOR_DTYPES:
        raise CheckpointError(
            f"{weights}: {entry.name!r} is {entry.dtype}; quantized or non-float adapters are not supported: "
            "dequantize it to F32, F16 or BF16 and save it again"
        )


def check_rows(tensor: str, rows: int, row_start: int, row_end: int) -> None:
    """Refuse a row run outside ``[0, rows]`` (a caller's bug, hence ``ValueError``)."""
    if not 0 <= row_start <= row_end <= rows:
        raise ValueError(f"rows [{row_start}, {row_end}) are outside tensor {tensor!r} of {rows} rows")
