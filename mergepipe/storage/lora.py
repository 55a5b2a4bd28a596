"""A PEFT LoRA adapter as exact deltas of its base's tensors: its config's patterns matched as PEFT matches
them (in RE2), keys mapped to base tensors, replacements, unsupported variants refused; ``delta_rows``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import re2
from pydantic import BaseModel, ConfigDict, FiniteFloat, PositiveInt, PrivateAttr, ValidationError

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.format import MERGEABLE_DTYPES, SafetensorsHeader, TensorEntry, read_header

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_BIN_FILE = "adapter_model.bin"
KEY_PREFIX = "base_model.model."
BASE_LAYER = "base_layer"
ALL_LINEAR = "all-linear"  # PEFT's shorthand, resolved from the live model's layer types: selects every module
MERGE_FIRST = "merge it into its base with peft's merge_and_unload() and register the result as a full checkpoint"
_FIX = "re-save it with peft's save_pretrained"
_OTHER_BASE = "the adapter was trained on another model; register it against its own base"

# How PEFT wraps a pattern before re.match: modules_to_save entries, rank/alpha_pattern keys, layers_pattern.
SAVED = r"(^|.*\.){}($|\..*)"
KEY = r"(.*\.)?({})$"
LAYERS = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."
# What RE2 accepts but reads otherwise than Python's re: {,n} (text to RE2), POSIX classes (characters to re).
_READ_OTHERWISE = re.compile(r"\{,\d*\}|\[:\^?[a-z]+:\]")
# Truthy values of these fields make a LoRA variant whose merged weight is not W + s·B·A.
_VARIANT_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "velora_config": "VeLoRA (velora_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens), which cannot be merged",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
}
# init_lora_weights values whose adapter is relative to modified base weights, or a variant.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "mica")
# (key suffix, factor, embedding?)
_FACTOR_SUFFIXES = (
    (".lora_A.weight", "A", False),
    (".lora_B.weight", "B", False),
    (".lora_embedding_A", "A", True),
    (".lora_embedding_B", "B", True),
)
#: The base's tensors, name -> (safetensors dtype, shape): what the catalog records.
BaseTensors = Mapping[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True, repr=False)
class PeftRegex:
    """A config pattern as PEFT applies it."""

    source: str
    compiled: Any = field(compare=False)
    whole: bool = False
    lookaheads: tuple[tuple[bool, Any], ...] = field(default=(), compare=False)

    def match(self, module: str) -> Any:
        for wanted, ahead in self.lookaheads:
            if (ahead.match(module) is not None) != wanted:
                return None
        return self.compiled.fullmatch(module) if self.whole else self.compiled.match(module)

    def __repr__(self) -> str:
        return repr(self.source)


def _re2(pattern: str) -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our one-line error, not a line of RE2's log on stderr
    return re2.compile(pattern, options)


#: PEFT's rule for a layer index when no layers_pattern is given: the first numbered path segment.
ANY_LAYER = _re2(r".*?\.[^.]*\.(?P<idx>\d+)\.")


def peft_regex(path: Path, name: str, source: str, template: str = "{}", whole: bool = False) -> PeftRegex:
    """``source`` from field ``name`` of the config at ``path``, wrapped as PEFT wraps it, checked by Python's re."""
    pattern = template.format(source)
    shown = repr(source) if len(repr(source)) <= 80 else repr(source)[:77] + "..."
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re's FutureWarnings (a "[[" in a class): not for our one line
            re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, re.error) else exc  # re's positions would count PEFT's wrapping
        raise CorruptCheckpointError(
            f"{path}: {name} {shown} is not a valid regular expression ({_first_line(reason)}), so peft "
            f"cannot load this adapter either; correct the pattern in {path.name}"
        ) from None
    odd = _READ_OTHERWISE.search(pattern)
    reason = f"{odd.group()} means one thing to Python's re and another to RE2" if odd is not None else ""
    if not reason:
        lookaheads, rest = _leading_lookaheads(pattern) if whole else ((), pattern)
        try:
            return PeftRegex(source, _re2(rest), whole, tuple((wanted, _re2(body)) for wanted, body in lookaheads))
        except re2.error as exc:
            text = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
            reason = f"RE2: {_first_line(text)}"
    raise CheckpointError(
        f"{path}: {name} {shown} cannot be matched in linear time ({reason}); MergePipe matches adapter "
        "patterns with RE2 so that no pattern can stall it (no lookbehinds or backreferences; lookaheads only "
        "at the start of a target_modules or exclude_modules string): rewrite the pattern, or merge the "
        "adapter into its base with peft's merge_and_unload() and register the result"
    )


def _leading_lookaheads(pattern: str) -> tuple[tuple[tuple[bool, str], ...], str]:
    """``^(?!A)(?=B)REST`` as ``((False, "A"), (True, "B"))`` and ``REST``."""
    at = 1 if pattern.startswith("^") else 0
    found = []
    while pattern.startswith(("(?=", "(?!"), at):
        end = next((i for i, char, depth in _structure(pattern, at) if char == ")" and depth == 0), None)
        if end is None:  # a (?#comment) holding a parenthesis: RE2 refuses the whole pattern
            return (), pattern
        found.append((pattern[at + 2] == "=", pattern[at + 3 : end]))
        at = end + 1
    rest = pattern[at:]
    if (
        not found
        or rest.startswith(("*", "+", "?", "{"))
        or any(char == "|" and depth == 0 for _, char, depth in _structure(rest, 0))
    ):
        return (), pattern
    return tuple(found), rest


def _structure(pattern: str, start: int) -> Iterator[tuple[int, str, int]]:
    """``(index, char, depth)`` of each character from ``start`` outside escapes and character classes."""
    depth, at = 0, start
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at += 2
            continue
        if char == "[":
            at += 2 if pattern.startswith("[^", at) else 1
            at += pattern.startswith("]", at)  # a ] first in a class is a character
            while at < len(pattern) and pattern[at] != "]":
                at += 2 if pattern[at] == "\\" else 1
            at += 1
            continue
        depth += (char == "(") - (char == ")")
        yield at, char, depth
        at += 1


def _first_line(value: Any) -> str:
    lines = str(value).splitlines()
    return lines[0] if lines else ""


Names = PeftRegex | tuple[str, ...] | None


class AdapterConfig(BaseModel):
    """The fields of ``adapter_config.json`` that decide ΔW, typed as PEFT writes them."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    path: Path
    sha256: str
    r: PositiveInt
    lora_alpha: FiniteFloat
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    target_modules: str | list[str] | None = None
    exclude_modules: str | list[str] | None = None
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, PositiveInt] | None = None
    alpha_pattern: dict[str, FiniteFloat] | None = None
    layers_to_transform: int | list[int] | None = None
    layers_pattern: str | list[str] | None = None
    _target: Names = PrivateAttr(None)
    _exclude: Names = PrivateAttr(None)
    _saved: tuple[PeftRegex, ...] = PrivateAttr(())
    _ranks: tuple[tuple[PeftRegex, int], ...] = PrivateAttr(())
    _alphas: tuple[tuple[PeftRegex, float], ...] = PrivateAttr(())
    _layers: tuple[PeftRegex, ...] = PrivateAttr(())

    def model_post_init(self, context: Any) -> None:
        def names(name: str, value: str | list[str] | None) -> Names:  # a string: a whole-path regex; a list: names
            if isinstance(value, str):
                return peft_regex(self.path, name, value, whole=True)
            return None if value is None else tuple(value)

        def patterns(name: str, value: dict[str, Any] | None) -> tuple[tuple[PeftRegex, Any], ...]:
            return tuple((peft_regex(self.path, name, key, KEY), item) for key, item in (value or {}).items())

        layers = self.layers_pattern or []
        self._target = names("target_modules", self.target_modules)
        self._exclude = names("exclude_modules", self.exclude_modules)
        self._saved = tuple(peft_regex(self.path, "modules_to_save", s, SAVED) for s in self.modules_to_save or ())
        self._ranks = patterns("rank_pattern", self.rank_pattern)
        self._alphas = patterns("alpha_pattern", self.alpha_pattern)
        self._layers = tuple(
            peft_regex(self.path, "layers_pattern", s, LAYERS)
            for s in ([layers] if isinstance(layers, str) else layers)
        )

    def rank_of(self, module: str) -> int:
        return _pattern_value(self._ranks, module, self.r)

    def alpha_of(self, module: str) -> float:
        return _pattern_value(self._alphas, module, self.lora_alpha)

    def scale_of(self, module: str) -> float:
        """s = alpha/r, or alpha/sqrt(r) with rsLoRA, as a Python float like PEFT's ``scaling``."""
        r = self.rank_of(module)
        return self.alpha_of(module) / (math.sqrt(r) if self.use_rslora else r)

    def saves(self, module: str) -> bool:
        return any(saved.match(module) for saved in self._saved)

    def targets(self, module: str) -> bool:
        """Whether PEFT puts LoRA on ``module`` (``None`` or ``all-linear`` select every module)."""
        if _listed(self._exclude, module) or self.saves(module):
            return False
        chosen = self._target
        if chosen is None or (isinstance(chosen, PeftRegex) and chosen.source.lower() == ALL_LINEAR):
            return True
        if isinstance(chosen, PeftRegex):
            return chosen.match(module) is not None
        if module in chosen:
            return True
        if not any(module.endswith(f".{name}") for name in chosen):
            return False
        wanted = self.layers_to_transform
        if wanted is None or wanted == []:
            return True
        found = None
        for pattern in self._layers or (ANY_LAYER,):  # PEFT's rule: the first numbered segment
            found = pattern.match(module)
            if found is not None:
                break
        index = found.groupdict().get("idx") if found else None
        if index is None:
            return False
        return int(index) == wanted if isinstance(wanted, int) else int(index) in wanted


def _pattern_value(pattern: tuple[tuple[PeftRegex, Any], ...], module: str, default: Any) -> Any:
    for key, value in pattern:
        if key.match(module):
            return value
    return {key.source: value for key, value in pattern}.get(module, default)  # PEFT's lookup of the path itself


def _listed(names: Names, module: str) -> bool:
    if not names:
        return False
    if isinstance(names, PeftRegex):
        return names.match(module) is not None
    return module in names or any(module.endswith(f".{name}") for name in names)


def read_adapter_config(root: Path) -> AdapterConfig:
    """Read and check ``root/adapter_config.json``."""
    path = root / ADAPTER_CONFIG_FILE
    try:
        raw = path.read_bytes()
        doc = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{root} has no {ADAPTER_CONFIG_FILE}; give the folder written by peft's save_pretrained"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptCheckpointError(f"{path} is not valid JSON; {_FIX}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} is a JSON {type(doc).__name__}, not an object; {_FIX}")
    _refuse_unsupported(path, doc)
    try:
        return AdapterConfig.model_validate({**doc, "path": path, "sha256": hashlib.sha256(raw).hexdigest()})
    except ValidationError as exc:
        error = exc.errors()[0]
        name = error["loc"][0]
        raise CorruptCheckpointError(f"{path}: {name} is {repr(doc.get(name))[:80]}: {error['msg']}; {_FIX}") from None


def _refuse_unsupported(path: Path, doc: dict[str, Any]) -> None:
    peft_type = doc.get("peft_type")
    if peft_type != "LORA":
        raise CheckpointError(
            f"{path}: peft_type is {peft_type!r}; MergePipe reads LoRA adapters (peft_type LORA) only: {MERGE_FIRST}"
        )
    for name, what in _VARIANT_FIELDS.items():
        if doc.get(name):
            raise CheckpointError(f"{path}: {what} is not supported: {MERGE_FIRST}")
    if doc.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: trained biases (bias={doc['bias']!r}) are not supported: {MERGE_FIRST}")
    init = doc.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise CheckpointError(
            f"{path}: init_lora_weights={init!r} makes the adapter relative to a modified base; "
            f"convert it with save_pretrained(path_initial_model_for_weight_conversion=...) or {MERGE_FIRST}"
        )


@dataclass(frozen=True)
class LoraTarget:
    """LoRA on one base tensor."""

    tensor: str
    module: str
    path: Path
    a: TensorEntry
    b: TensorEntry
    rank: int
    scale: float
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        """ΔW's shape: the base tensor's."""
        return (self.a.shape[1], self.b.shape[0]) if self.transposed else (self.b.shape[0], self.a.shape[1])

    @property
    def factor_bytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


@dataclass(frozen=True)
class SavedTensor:
    """A tensor the adapter stores whole, replacing base tensor ``tensor``."""

    tensor: str
    path: Path
    entry: TensorEntry
    origin: str


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
        return sum(t.factor_bytes for t in self.targets.values())

    @property
    def saved_bytes(self) -> int:
        return sum(s.entry.nbytes for s in self.saved.values())


def open_lora_adapter(path: str | os.PathLike[str], base_tensors: BaseTensors) -> LoraAdapter:
    """Open the PEFT adapter at ``path`` against its base's tensors, reading the config and header only."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"no such adapter directory: {root} (give the folder written by peft's save_pretrained)")
    config = read_adapter_config(root)
    weights = root / ADAPTER_WEIGHTS_FILE
    if not weights.is_file():
        if (root / ADAPTER_BIN_FILE).is_file():
            raise CheckpointError(
                f"{root / ADAPTER_BIN_FILE} is a pickled adapter; convert it to safetensors (load it with peft "
                f"and save_pretrained(..., safe_serialization=True)) and register {root} again"
            )
        raise CheckpointError(
            f"{root} has no {ADAPTER_WEIGHTS_FILE}; give the folder written by peft's save_pretrained"
        )
    header = read_header(weights)
    factors: dict[str, dict[str, TensorEntry]] = {}
    embedding: dict[str, set[bool]] = {}
    saved: dict[str, SavedTensor] = {}
    replacements = []
    for entry in header.tensors.values():
        kind, module, tensor, is_embedding = _classify(weights, entry.name)
        if kind in ("A", "B"):
            factors.setdefault(module, {})[kind] = entry
            embedding.setdefault(module, set()).add(is_embedding)
        else:
            replacements.append((kind, module, tensor, entry))
    if not factors and not replacements:
        raise CheckpointError(f"{weights} holds no tensors; {_FIX}")
    targets = [_target(weights, config, m, parts, embedding[m], base_tensors) for m, parts in factors.items()]
    for kind, module, tensor, entry in replacements:
        # PEFT's loader puts base_layer tensors only under LoRA modules, and a LoRA module's own weights only
        # under base_layer: anything else it would silently drop.
        if (kind == "copy") != (module in factors):
            what = "the base_layer of a module without LoRA factors" if kind == "copy" else "a weight of a LoRA module"
            what += "" if kind == "copy" else " saved outside its base_layer"
            raise CheckpointError(f"{weights}: {entry.name!r} is {what}, which peft would ignore; {_FIX}")
        if tensor not in base_tensors:
            raise CheckpointError(f"{weights}: {entry.name!r} maps to no base tensor {tensor!r}; {_OTHER_BASE}")
        _check_float(weights, entry)
        base_shape = tuple(base_tensors[tensor][1])
        if entry.shape != base_shape:
            raise CheckpointError(
                f"{weights}: saved tensor {entry.name!r} is {list(entry.shape)} but base tensor {tensor!r} is "
                f"{list(base_shape)} (a resized vocabulary?); register it against the base it was trained on"
            )
        if tensor in saved:
            raise CorruptCheckpointError(f"{weights}: two tensors replace base tensor {tensor!r}; {_FIX}")
        origin = "base_layer" if kind == "copy" else "modules_to_save" if config.saves(module) else "saved"
        saved[tensor] = SavedTensor(tensor=tensor, path=weights, entry=entry, origin=origin)
    order = {name: i for i, name in enumerate(base_tensors)}
    return LoraAdapter(
        root=root,
        config=config,
        weights=weights,
        header=header,
        targets={t.tensor: t for t in sorted(targets, key=lambda t: order[t.tensor])},
        saved={name: saved[name] for name in sorted(saved, key=order.__getitem__)},
    )


def _classify(weights: Path, key: str) -> tuple[str, str, str, bool]:
    """``(kind, module, base tensor, embedding?)`` of an adapter key."""
    if not key.startswith(KEY_PREFIX):
        raise CheckpointError(f"{weights}: tensor {key!r} does not start with {KEY_PREFIX!r}; {_FIX}")
    rest = key[len(KEY_PREFIX) :]
    for suffix, kind, is_embedding in _FACTOR_SUFFIXES:
        if rest.endswith(suffix):
            module = rest[: -len(suffix)]
            return kind, module, f"{module}.weight", is_embedding
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
        return "copy", ".".join(segments[:at]), ".".join(segments[:at] + segments[at + 1 :]), False
    return "saved", rest.rpartition(".")[0], rest, False


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
    if base_dtype not in MERGEABLE_DTYPES:
        raise CheckpointError(
            f"{weights}: base tensor {tensor!r} is {base_dtype}; LoRA on a quantized base cannot be merged exactly: "
            "register the adapter against the unquantized base"
        )
    _check_float(weights, a)
    _check_float(weights, b)
    rank = config.rank_of(module)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise CheckpointError(
            f"{weights}: factors of {module!r} are A {list(a.shape)}, B {list(b.shape)}, not (rank, n) and "
            f"(m, rank) with the rank {rank} that {config.path.name} gives it (r, rank_pattern); {_FIX}"
        )
    transposed = kinds == {True} or config.fan_in_fan_out
    target = LoraTarget(tensor, module, weights, a, b, rank, config.scale_of(module), transposed)
    if target.shape != tuple(base_shape):
        raise CheckpointError(
            f"{weights}: ΔW = {'(B·A)ᵀ' if transposed else 'B·A'} of {module!r} is {list(target.shape)} but base "
            f"tensor {tensor!r} is {list(base_shape)} (fan_in_fan_out={config.fan_in_fan_out}); {_OTHER_BASE}"
        )
    return target


def _check_float(weights: Path, entry: TensorEntry) -> None:
    if entry.dtype not in MERGEABLE_DTYPES:
        raise CheckpointError(
            f"{weights}: {entry.name!r} is {entry.dtype}; quantized or non-float adapters are not supported: "
            "dequantize it to F32, F16 or BF16 and save it again"
        )


#: Rows of ΔW summed at a time, by elements: a piece and its rank-1 term stay in a core's cache.
PIECE_ELEMENTS = 1 << 18


def delta_rows(b: torch.Tensor, a: torch.Tensor, scale: float, transposed: bool) -> torch.Tensor:
    """fp32 ΔW of n rows."""
    import torch

    left, right = (a.float().T, b.float().T) if transposed else (b.float(), a.float())
    n, rank = left.shape
    out = torch.empty((n, right.shape[1]), dtype=torch.float32)
    step = max(1, PIECE_ELEMENTS // max(1, right.shape[1]))
    term = torch.empty((min(step, n), right.shape[1]), dtype=torch.float32)
    for start in range(0, n, step):
        end = min(start + step, n)
        piece, scratch = out[start:end], term[: end - start]
        torch.mul(left[start:end, :1], right[:1], out=piece)
        for k in range(1, rank):
            piece.add_(torch.mul(left[start:end, k : k + 1], right[k : k + 1], out=scratch))
    return out.mul_(scale)
