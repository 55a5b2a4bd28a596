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

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import re2

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.format import SafetensorsHeader, TensorEntry, read_header

# How PEFT wraps a pattern ({} is the pattern as the file has it) before re.match: modules_to_save entries,
# rank_pattern / alpha_pattern keys, layers_pattern entries.
SAVED = r"(^|.*\.){}($|\..*)"
KEY = r"(.*\.)?({})$"
LAYERS = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."
# What RE2 accepts but reads otherwise than Python's re: {,n} (text to RE2), POSIX classes (characters to re).
_READ_OTHERWISE = re.compile(r"\{,\d*\}|\[:\^?[a-z]+:\]")


@dataclass(frozen=True, repr=False)
class PeftRegex:
    """One pattern of the config, compiled as PEFT applies it and matched by RE2.

    ``source`` is the pattern as the file has it (and its repr). ``whole``: the path must match in full
    (PEFT's ``re.fullmatch``), else from its start (``re.match``). ``lookaheads``: the ``(?=…)``/``(?!…)``
    groups that opened a whole-path pattern, as (must match?, body), each tried at the start of the path.
    """

    source: str
    compiled: Any = dataclasses.field(compare=False)
    whole: bool = False
    lookaheads: tuple[tuple[bool, Any], ...] = dataclasses.field(default=(), compare=False)

    def match(self, module: str) -> Any:
        """RE2's match object for ``module``, or None."""
        for wanted, ahead in self.lookaheads:
            if (ahead.match(module) is not None) != wanted:
                return None
        return self.compiled.fullmatch(module) if self.whole else self.compiled.match(module)

    def __repr__(self) -> str:
        return repr(self.source)


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our one-line error, not a line of RE2's log on stderr
    return options


#: PEFT's rule for a layer index when no layers_pattern is given: the first numbered path segment.
ANY_LAYER = re2.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.", _re2_options())


def peft_regex(path: Path, field: str, source: str, template: str = "{}", whole: bool = False) -> PeftRegex:
    """``source`` from ``field`` of the config at ``path``, wrapped in ``template`` as PEFT wraps it,
    checked by Python's re (which PEFT runs) and compiled for RE2; refused, naming ``field``, where either
    cannot take it."""
    pattern = template.format(source)
    shown = _shown(source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re's FutureWarnings (a "[[" in a class): not for our one line
            re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, re.error) else exc  # re's positions would count PEFT's wrapping
        raise CorruptCheckpointError(
            f"{path}: {field} {shown} is not a valid regular expression ({_first_line(reason)}), so peft "
            f"cannot load this adapter either; correct the pattern in {path.name}"
        ) from None
    odd = _READ_OTHERWISE.search(pattern)
    if odd is not None:
        raise _unmatchable(path, field, shown, f"{odd.group()} means one thing to Python's re and another to RE2")
    lookaheads, rest = _leading_lookaheads(pattern) if whole else ((), pattern)
    options = _re2_options()
    try:
        return PeftRegex(
            source,
            re2.compile(rest, options),
            whole,
            tuple((wanted, re2.compile(body, options)) for wanted, body in lookaheads),
        )
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise _unmatchable(path, field, shown, f"RE2: {_first_line(reason)}") from None


def _unmatchable(path: Path, field: str, shown: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {field} {shown} cannot be matched in linear time ({reason}); MergePipe matches adapter "
        "patterns with RE2 so that no pattern can stall it (no lookbehinds or backreferences; lookaheads only "
        "at the start of a target_modules or exclude_modules string): rewrite the pattern, or merge the "
        "adapter into its base with peft's merge_and_unload() and register the result"
    )


def _leading_lookaheads(pattern: str) -> tuple[tuple[tuple[bool, str], ...], str]:
    """``^(?!A)(?=B)REST`` as ``((False, "A"), (True, "B"))`` and ``REST``: in a whole-path match, a
    lookahead that opens the pattern means "its body matches (or not) from the start of the path". Any
    other pattern, or one whose top level has a ``|`` (the lookaheads would open its first branch only),
    comes back whole."""
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
    """``(index, char, depth)`` of each character of ``pattern`` from ``start`` outside escapes and
    character classes; depth counts the groups open after it (a ``)`` has the depth it closes to)."""
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


def _shown(source: str) -> str:
    """A pattern for a one-line message: its repr, cut short."""
    text = repr(source)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_line(value: Any) -> str:
    lines = str(value).splitlines()
    return lines[0] if lines else ""


ADAPTER_CONFIG_FILE = "adapter_config.json"
# PEFT's shorthand that its own loader expands from the live model's layer types.
ALL_LINEAR = "all-linear"

# What to do with an adapter we cannot read: PEFT can always merge it for us.
MERGE_FIRST = "merge it into its base with peft's merge_and_unload() and register the result as a full checkpoint"

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


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` that decide ΔW, validated.

    Patterns keep the file's order (the first matching key wins). ``sha256``
    hashes the file's bytes as stored, for manifests.
    """

    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool
    fan_in_fan_out: bool
    target_modules: PeftRegex | tuple[str, ...] | None
    exclude_modules: PeftRegex | tuple[str, ...] | None
    modules_to_save: tuple[PeftRegex, ...]
    rank_pattern: tuple[tuple[PeftRegex, int], ...]
    alpha_pattern: tuple[tuple[PeftRegex, float], ...]
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[PeftRegex, ...]
    sha256: str

    def rank_of(self, module: str) -> int:
        """The module's rank: its ``rank_pattern`` entry, else ``r``."""
        return _pattern_value(self.rank_pattern, module, self.r)

    def alpha_of(self, module: str) -> float:
        """The module's alpha: its ``alpha_pattern`` entry, else ``lora_alpha``."""
        return _pattern_value(self.alpha_pattern, module, self.lora_alpha)

    def scale_of(self, module: str) -> float:
        """s = alpha/r, or alpha/sqrt(r) with rsLoRA, as a Python float like PEFT's ``scaling``."""
        r = self.rank_of(module)
        return self.alpha_of(module) / (math.sqrt(r) if self.use_rslora else r)

    def saves(self, module: str) -> bool:
        """Is ``module`` (a path without ``.weight``) one of ``modules_to_save``?"""
        return any(saved.match(module) for saved in self.modules_to_save)

    def targets(self, module: str) -> bool:
        """Does this config put LoRA on ``module``? (PEFT's rule; see the module docstring.)

        ``None`` or ``all-linear`` cannot be checked from names (PEFT resolves
        them from the live model's types), so every module passes.
        """
        if _listed(self.exclude_modules, module) or self.saves(module):
            return False
        chosen = self.target_modules
        if chosen is None or (isinstance(chosen, PeftRegex) and chosen.source.lower() == ALL_LINEAR):
            return True
        if isinstance(chosen, PeftRegex):
            return chosen.match(module) is not None
        if module in chosen:
            return True
        if not any(module.endswith(f".{name}") for name in chosen):
            return False
        wanted = self.layers_to_transform
        if wanted is None or wanted == ():
            return True
        index = _layer_index(module, self.layers_pattern)
        if index is None:
            return False
        return index == wanted if isinstance(wanted, int) else index in wanted


def _pattern_value(pattern: tuple[tuple[PeftRegex, Any], ...], module: str, default: Any) -> Any:
    for key, value in pattern:
        if key.match(module):
            return value
    # PEFT falls back to a lookup of the module path itself.
    return {key.source: value for key, value in pattern}.get(module, default)


def _listed(names: PeftRegex | tuple[str, ...] | None, module: str) -> bool:
    if not names:
        return False
    if isinstance(names, PeftRegex):
        return names.match(module) is not None
    return module in names or any(module.endswith(f".{name}") for name in names)


def _layer_index(module: str, layers_pattern: tuple[PeftRegex, ...]) -> int | None:
    """The first numbered path segment (after one of ``layers_pattern``, when given)."""
    if not layers_pattern:
        found = ANY_LAYER.match(module)
    else:
        found = None
        for pattern in layers_pattern:
            found = pattern.match(module)
            if found is not None:
                break
    index = found.groupdict().get("idx") if found else None
    return int(index) if index is not None else None


def read_adapter_config(root: Path) -> AdapterConfig:
    """Read and check ``root/adapter_config.json`` (see the module docstring for what is refused)."""
    path = root / ADAPTER_CONFIG_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{root} has no {ADAPTER_CONFIG_FILE}; give the folder written by peft's save_pretrained"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CorruptCheckpointError(f"{path} is not valid JSON; {_FIX}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} is a JSON {type(doc).__name__}, not an object; {_FIX}")
    _refuse_unsupported(path, doc)
    return AdapterConfig(
        path=path,
        r=_positive_int(path, "r", doc.get("r")),
        lora_alpha=_number(path, "lora_alpha", doc.get("lora_alpha")),
        use_rslora=_flag(path, doc, "use_rslora"),
        fan_in_fan_out=_flag(path, doc, "fan_in_fan_out"),
        target_modules=_names(path, "target_modules", doc.get("target_modules")),
        exclude_modules=_names(path, "exclude_modules", doc.get("exclude_modules")),
        modules_to_save=_regexes(path, "modules_to_save", doc.get("modules_to_save"), SAVED),
        rank_pattern=_pattern(path, "rank_pattern", doc.get("rank_pattern"), _positive_int),
        alpha_pattern=_pattern(path, "alpha_pattern", doc.get("alpha_pattern"), _number),
        layers_to_transform=_layers(path, doc.get("layers_to_transform")),
        layers_pattern=_layers_pattern(path, doc.get("layers_pattern")),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def _refuse_unsupported(path: Path, doc: dict[str, Any]) -> None:
    peft_type = doc.get("peft_type")
    if peft_type != "LORA":
        raise CheckpointError(
            f"{path}: peft_type is {peft_type!r}; MergePipe reads LoRA adapters (peft_type LORA) only: {MERGE_FIRST}"
        )
    for field, what in _VARIANT_FIELDS.items():
        if doc.get(field):
            raise CheckpointError(f"{path}: {what} is not supported: {MERGE_FIRST}")
    bias = doc.get("bias", "none")
    if bias != "none":
        raise CheckpointError(f"{path}: trained biases (bias={bias!r}) are not supported: {MERGE_FIRST}")
    init = doc.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise CheckpointError(
            f"{path}: init_lora_weights={init!r} makes the adapter relative to a modified base; "
            f"convert it with save_pretrained(path_initial_model_for_weight_conversion=...) or {MERGE_FIRST}"
        )


def _bad(path: Path, field: str, value: Any, want: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {field} is {value!r}, not {want}; {_FIX}")


def _positive_int(path: Path, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(path, field, value, "a positive integer")
    return value


def _number(path: Path, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(path, field, value, "a number")
    return value


def _flag(path: Path, doc: dict[str, Any], field: str) -> bool:
    value = doc.get(field, False)
    if not isinstance(value, bool):
        raise _bad(path, field, value, "true or false")
    return value


def _name_list(path: Path, field: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(path, field, value, "a list of module names")
    return tuple(value)


def _names(path: Path, field: str, value: Any) -> PeftRegex | tuple[str, ...] | None:
    """A string is a whole-path regex; a list holds names matched as text (PEFT's equal-or-suffix rule)."""
    if value is None:
        return None
    if isinstance(value, str):
        return peft_regex(path, field, value, whole=True)
    return _name_list(path, field, value)


def _regexes(path: Path, field: str, value: Any, template: str) -> tuple[PeftRegex, ...]:
    return tuple(peft_regex(path, field, name, template) for name in _name_list(path, field, value))


def _pattern(path: Path, field: str, value: Any, check) -> tuple[tuple[PeftRegex, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(path, field, value, "an object of module patterns")
    return tuple(
        (peft_regex(path, field, key, KEY), check(path, f"{field}[{key!r}]", item)) for key, item in value.items()
    )


def _layers(path: Path, value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise _bad(path, "layers_to_transform", value, "an integer or a list of integers")


def _layers_pattern(path: Path, value: Any) -> tuple[PeftRegex, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = [value]
    return _regexes(path, "layers_pattern", value, LAYERS)


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
    rest = key[len(KEY_PREFIX) :]
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
        tensor=tensor,
        module=module,
        path=weights,
        a=a,
        b=b,
        rank=rank,
        alpha=config.alpha_of(module),
        scale=config.scale_of(module),
        transposed=transposed,
        embedding=embedding,
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
            what = (
                "the base_layer of a module without LoRA factors"
                if key.kind == "copy"
                else ("a weight of a LoRA module saved outside its base_layer")
            )
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
