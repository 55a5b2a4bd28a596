"""A frankenmerge as an explicit copy map: every output tensor is one tensor of one source model.

mergekit's ``passthrough`` over ``slices:`` (each slice one source: ``model`` and ``layer_range:
[first, end)``) stacks layers. The output's layers are the slices' layers in order, renumbered from 0:
layers [0, 4) of A then [2, 6) of B make an 8-layer model whose layer 4 is B's layer 2; a model may be
stacked on itself. The tensors outside the layers come from where mergekit 0.1.5 takes them
(``MergePlanner.plan_module``): the embeddings (its architectures' ``pre_weights``) from the first
slice's model, the rest (final norm, lm_head: ``post_weights``) from the last slice's. MergePipe carries
no architecture tables: a tensor outside the layers is an embedding when a part of its name contains
``embed`` or is GPT-2's ``wte``/``wpe``.

The output's config.json is the base's (``base_model``, else the first slice's model), with its layer
count and its per-layer lists (``layer_types``) rewritten for the stacked layers (``output_config``), so
that transformers loads what was written.

The map is checked against the base before anything is read: every layer tensor must be one the base
has at every layer (the same name after the layer index, the same shape), and the tensors outside the
layers must be the base's own, with its shapes: slices stack layers of models of one architecture and
size. Pure: names and shapes in (the planner gives the catalog's records), the map out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergepipe.errors import ConfigError
from mergepipe.spec import canonical as fields
from mergepipe.spec.settings import layer_parts

#: The method whose output is a copy map (mergekit's name).
PASSTHROUGH = "passthrough"
#: Keys of config.json that hold the layer count (``analysis/describe.py`` reads the same ones).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
#: Keys of config.json that hold one entry per layer.
PER_LAYER_KEYS = ("layer_types",)
#: The end of a layer range up to a model's last layer, whatever their number: passthrough's ``models:``
#: (mergekit's copy of one model) is one slice of all its layers, known once the model is (``app/registering.py``).
ALL_LAYERS = 2**31
#: A part of a tensor name that makes it an embedding (mergekit's ``pre_weights``) outside the layers.
_EMBEDDING = re.compile(r"(?:^|\.)(?:[^.]*embed[^.]*|wte|wpe)(?:\.|$)")

#: A tensor's name and shape, as the catalog records it.
Shape = tuple[int, ...]


@dataclass(frozen=True)
class LayerSlice:
    """Layers ``[first, end)`` of ``model``: one slice's one source (a reference as written, or an id)."""

    model: str
    first: int
    end: int

    def __post_init__(self) -> None:
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.first, self.end))
        if not isinstance(self.model, str) or not self.model or not ok or not 0 <= self.first < self.end:
            raise ConfigError(
                f"a slice is a model and layer_range [FIRST, END] with 0 <= FIRST < END, got "
                f"{self.model!r} [{self.first!r}, {self.end!r}]"
            )

    @property
    def layers(self) -> int:
        return self.end - self.first

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "layer_range": [self.first, self.end]}

    @classmethod
    def from_json(cls, data: Any) -> LayerSlice:
        d = fields.keys(data, ("model", "layer_range"), "slice")
        first, end = (fields.integer(v, "slice layer_range") for v in fields.array(d["layer_range"], "layer_range"))
        return cls(fields.text(d["model"], "slice model"), first, end)


@dataclass(frozen=True)
class TensorCopy:
    """Output tensor ``output`` is tensor ``tensor`` of model ``model``, as it is."""

    output: str
    model: str
    tensor: str


@dataclass(frozen=True)
class CopyMap:
    """The slices as planned (exact model ids) and every output tensor's source, in output order."""

    slices: tuple[LayerSlice, ...]
    copies: tuple[TensorCopy, ...]

    @property
    def layers(self) -> int:
        """The output's layer count."""
        return sum(s.layers for s in self.slices)

    @property
    def models(self) -> tuple[str, ...]:
        """The source models, in the order the slices first name them."""
        return tuple(dict.fromkeys(s.model for s in self.slices))

    def source_layers(self) -> list[int]:
        """Per output layer, the layer of its source it is."""
        return [i for s in self.slices for i in range(s.first, s.end)]

    def output_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The base's config.json (``config``) for the output: its layer count (the first of
        ``LAYER_COUNT_KEYS`` it has) set to the output's, each per-layer list taken at every output layer's
        source layer (an entry the base's list lacks is refused, unless the list is one value throughout)."""
        out = dict(config)
        for key in LAYER_COUNT_KEYS:
            if isinstance(config.get(key), int) and not isinstance(config[key], bool):
                out[key] = self.layers
                break
        for key in PER_LAYER_KEYS:
            values = config.get(key)
            if isinstance(values, list) and values:
                out[key] = [_entry(values, i, key) for i in self.source_layers()]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "slices": [s.to_json() for s in self.slices],
            "tensors": [[c.output, c.model, c.tensor] for c in self.copies],
        }

    @classmethod
    def from_json(cls, data: Any) -> CopyMap:
        d = fields.keys(data, ("slices", "tensors"), "copy map")
        slices = tuple(LayerSlice.from_json(s) for s in fields.array(d["slices"], "copy map slices"))
        copies = []
        for row in fields.array(d["tensors"], "copy map tensors"):
            parts = fields.array(row, "copy map tensor")
            if len(parts) != 3:
                raise ValueError(f"a copy map tensor is [output, model, tensor], got {parts!r}")
            copies.append(TensorCopy(*(fields.text(p, "copy map tensor") for p in parts)))
        if not slices or not copies:
            raise ValueError("a copy map has slices and tensors")
        return cls(slices, tuple(copies))


def _entry(values: list[Any], layer: int, key: str) -> Any:
    if layer < len(values):
        return values[layer]
    if all(v == values[0] for v in values):
        return values[0]
    raise ConfigError(
        f"the base's config.json lists {key} for {len(values)} layers, and a slice takes layer "
        f"{layer}: give a base_model as deep as the deepest slice"
    )


def is_embedding(tensor_name: str) -> bool:
    """Whether a tensor outside the layers is an embedding (taken from the first slice's model)."""
    return _EMBEDDING.search(tensor_name) is not None


@dataclass(frozen=True)
class _Layout:
    """A model's tensors split as a copy map needs them: its one stack of layers and the rest."""

    prefix: str  # the name before a layer's index ("model.layers.")
    layers: dict[int, dict[str, tuple[str, Shape]]]  # layer -> name after the index -> (tensor name, shape)
    others: dict[str, Shape]  # tensors outside the layers, in file order

    @classmethod
    def of(cls, model: str, tensors: Sequence[tuple[str, Shape]]) -> _Layout:
        prefixes: set[str] = set()
        layers: dict[int, dict[str, tuple[str, Shape]]] = {}
        others: dict[str, Shape] = {}
        for name, shape in tensors:
            parts = layer_parts(name)
            if parts is None:
                others[name] = shape
                continue
            prefix, index, rest = parts
            prefixes.add(prefix)
            layers.setdefault(index, {})[rest] = (name, shape)
        if len(prefixes) != 1:
            found = ", ".join(repr(p) for p in sorted(prefixes)) or "none"
            raise ConfigError(
                f"slices stack the layers of one stack, and '{model}' has {len(prefixes) or 'no'} "
                f"stack{'s' if len(prefixes) != 1 else ''} of layers ({found}): not supported"
            )
        return cls(prefixes.pop(), layers, others)

    @property
    def count(self) -> int:
        return max(self.layers) + 1


def build_copy_map(
    slices: Sequence[LayerSlice], base: str, tensors: Mapping[str, Sequence[tuple[str, Shape]]]
) -> CopyMap:
    """The copy map of ``slices`` (model ids), checked against the base ``base``; ``tensors``: each model's
    tensors (name, shape) in file order, the base's and every slice model's. ConfigError naming the first
    slice, layer or tensor that does not fit (see the module docstring)."""
    if not slices:
        raise ConfigError("a passthrough needs at least one slice")
    layouts = {m: _Layout.of(m, tensors[m]) for m in dict.fromkeys([base, *(s.model for s in slices)])}
    donor = layouts[base]
    template = {rest: shape for per in donor.layers.values() for rest, (_, shape) in per.items()}
    copies = [TensorCopy(n, slices[0].model, n) for n in layouts[slices[0].model].others if is_embedding(n)]
    out = 0
    for s in slices:
        layout = layouts[s.model]
        if s.end > layout.count:
            raise ConfigError(f"slice layer_range [{s.first}, {s.end}] of '{s.model}': it has {layout.count} layers")
        for layer in range(s.first, s.end):
            have = layout.layers.get(layer, {})
            _check_layer(s.model, layer, layout.prefix, have, donor.prefix, template, base)
            copies.extend(TensorCopy(f"{donor.prefix}{out}{rest}", s.model, name) for rest, (name, _) in have.items())
            out += 1
    copies += [TensorCopy(n, slices[-1].model, n) for n in layouts[slices[-1].model].others if not is_embedding(n)]
    _check_others(copies, layouts, donor, base)
    return CopyMap(tuple(slices), tuple(copies))


def _check_layer(
    model: str,
    layer: int,
    prefix: str,
    have: Mapping[str, tuple[str, Shape]],
    base_prefix: str,
    template: Mapping[str, Shape],
    base: str,
) -> None:
    """Layer ``layer`` of ``model`` must have the base's layer tensors, with their shapes."""
    shapes = {rest: shape for rest, (_, shape) in have.items()}
    if prefix == base_prefix and shapes == template:
        return
    if prefix != base_prefix:
        why = f"its layers are '{prefix}N…', the base's '{base_prefix}N…'"
    elif set(shapes) != set(template):
        diff = sorted(set(shapes) ^ set(template))
        why = f"{len(diff)} tensor name(s) differ from the base's layers, e.g. '{prefix}{layer}{diff[0]}'"
    else:
        rest = next(r for r in template if shapes[r] != template[r])
        why = f"'{prefix}{layer}{rest}' has shape {list(shapes[rest])}, the base's {list(template[rest])}"
    raise ConfigError(
        f"layer {layer} of '{model}' does not fit the base '{base}': {why}; slices stack layers "
        "of models of one architecture and size"
    )


def _check_others(copies: Sequence[TensorCopy], layouts: Mapping[str, _Layout], donor: _Layout, base: str) -> None:
    """The output's tensors outside the layers must be the base's, with its shapes (its config describes
    them: vocabulary, tied embeddings)."""
    outside = {c.output: layouts[c.model].others[c.tensor] for c in copies if c.tensor in layouts[c.model].others}
    if outside == donor.others:
        return
    missing = sorted(set(donor.others) - set(outside))
    if missing:
        raise ConfigError(
            f"the output lacks '{missing[0]}', which the base '{base}' has (embeddings come from the "
            "first slice's model, the other tensors outside the layers from the last's); slices stack "
            "layers of models of one architecture and size"
        )
    extra = sorted(set(outside) - set(donor.others))
    if extra:
        source = next(c.model for c in copies if c.output == extra[0])
        raise ConfigError(
            f"the output has '{extra[0]}' (from '{source}'), which the base '{base}' lacks; slices "
            "stack layers of models of one architecture and size"
        )
    name = next(n for n in outside if outside[n] != donor.others[n])
    source = next(c.model for c in copies if c.output == name)
    raise ConfigError(
        f"'{name}' of '{source}' has shape {list(outside[name])}, the base '{base}' "
        f"{list(donor.others[name])}; slices stack layers of models of one architecture and size"
    )
