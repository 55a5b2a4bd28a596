"""A passthrough (mergekit's frankenmerge) as an explicit copy map: each output tensor is one source tensor,
the slices' layers stacked and renumbered, embeddings from the first slice's model, the other non-layer
tensors from the last's (mergekit 0.1.5's ``plan_module``); the output's config.json."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, NamedTuple

from pydantic import Field, model_serializer, model_validator
from pydantic.dataclasses import dataclass

from mergepipe.errors import ConfigError
from mergepipe.spec.canonical import STORED, Count, Stored, Text
from mergepipe.spec.settings import layer_parts

#: The method whose output is a copy map (mergekit's name).
PASSTHROUGH = "passthrough"
#: Keys of config.json that hold the layer count (``analysis/describe.py`` reads the same ones).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
#: Keys of config.json that hold one entry per layer.
PER_LAYER_KEYS = ("layer_types",)
#: The end of a layer range that stands for a model's last layer, whatever their number (``models:`` of a
#: passthrough copies one model whole; ``app/registering.py`` puts the count in).
ALL_LAYERS = 2**31
#: A part of a tensor name that makes a tensor outside the layers an embedding (mergekit's ``pre_weights``).
_EMBEDDING = re.compile(r"(?:^|\.)(?:[^.]*embed[^.]*|wte|wpe)(?:\.|$)")

_SAME_KIND = "slices stack layers of models of one architecture and size"

Shape = tuple[int, ...]


@dataclass(frozen=True, config=STORED)
class LayerSlice(Stored):
    """Layers ``[first, end)`` of ``model`` (a reference as written, or an id); stored as mergekit writes it."""

    model: Text
    first: Count
    end: Count

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        if isinstance(data, dict) and "layer_range" in data:
            data = dict(data)
            data["first"], data["end"] = data.pop("layer_range")
        return data

    @model_validator(mode="after")
    def _check(self) -> LayerSlice:
        if self.first >= self.end:
            raise ValueError(f"layer_range [{self.first}, {self.end}] of {self.model!r}: FIRST must be below END")
        return self

    @model_serializer
    def _write(self) -> dict[str, Any]:
        return {"model": self.model, "layer_range": [self.first, self.end]}

    @property
    def layers(self) -> int:
        return self.end - self.first


class TensorCopy(NamedTuple):
    """Output tensor ``output`` is tensor ``tensor`` of model ``model``, as it is."""

    output: str
    model: str
    tensor: str


@dataclass(frozen=True, config=STORED)
class CopyMap(Stored):
    """The slices as planned (exact model ids) and every output tensor's source, in output order."""

    slices: Annotated[tuple[LayerSlice, ...], Field(min_length=1)]
    copies: Annotated[tuple[TensorCopy, ...], Field(min_length=1, alias="tensors")]

    @property
    def layers(self) -> int:
        return sum(s.layers for s in self.slices)

    @property
    def models(self) -> tuple[str, ...]:
        """The source models, in the order the slices first name them."""
        return tuple(dict.fromkeys(s.model for s in self.slices))

    def source_layers(self) -> list[int]:
        """Per output layer, the layer of its source it is."""
        return [i for s in self.slices for i in range(s.first, s.end)]

    def output_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The base's config.json for the output: the layer count (the first of ``LAYER_COUNT_KEYS``) set,
        each per-layer list taken at every output layer's source layer."""
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


def _entry(values: list[Any], layer: int, key: str) -> Any:
    if layer < len(values):
        return values[layer]
    if all(v == values[0] for v in values):
        return values[0]
    raise ConfigError(
        f"the base's config.json lists {key} for {len(values)} layers, and a slice takes layer "
        f"{layer}: give a base_model as deep as the deepest slice"
    )


class _Layout(NamedTuple):
    """A model's one stack of layers (prefix; layer -> rest of name -> (name, shape)) and the other tensors."""

    prefix: str
    layers: dict[int, dict[str, tuple[str, Shape]]]
    others: dict[str, Shape]


def _layout(model: str, tensors: Sequence[tuple[str, Shape]]) -> _Layout:
    prefixes: set[str] = set()
    layout = _Layout("", {}, {})
    for name, shape in tensors:
        parts = layer_parts(name)
        if parts is None:
            layout.others[name] = shape
        else:
            prefixes.add(parts[0])
            layout.layers.setdefault(parts[1], {})[parts[2]] = (name, shape)
    if len(prefixes) != 1:
        found = ", ".join(repr(p) for p in sorted(prefixes)) or "none"
        raise ConfigError(
            f"slices stack the layers of one stack, and '{model}' has {len(prefixes) or 'no'} "
            f"stack{'s' if len(prefixes) != 1 else ''} of layers ({found}): not supported"
        )
    return layout._replace(prefix=prefixes.pop())


def build_copy_map(
    slices: Sequence[LayerSlice], base: str, tensors: Mapping[str, Sequence[tuple[str, Shape]]]
) -> CopyMap:
    """The copy map of ``slices`` from each model's ``tensors`` (name, shape); ConfigError for what does not fit."""
    if not slices:
        raise ConfigError("a passthrough needs at least one slice")
    layouts = {m: _layout(m, tensors[m]) for m in dict.fromkeys([base, *(s.model for s in slices)])}
    donor = layouts[base]
    template = {rest: shape for per in donor.layers.values() for rest, (_, shape) in per.items()}
    embedding = _EMBEDDING.search
    copies = [TensorCopy(n, slices[0].model, n) for n in layouts[slices[0].model].others if embedding(n)]
    out = 0
    for s in slices:
        layout = layouts[s.model]
        if s.end > max(layout.layers) + 1:
            raise ConfigError(
                f"slice layer_range [{s.first}, {s.end}] of '{s.model}': it has {max(layout.layers) + 1} layers"
            )
        for layer in range(s.first, s.end):
            have = layout.layers.get(layer, {})
            shapes = {rest: shape for rest, (_, shape) in have.items()}
            if layout.prefix != donor.prefix or shapes != template:
                why = _misfit(layout.prefix, donor.prefix, layer, shapes, template)
                raise ConfigError(f"layer {layer} of '{s.model}' does not fit the base '{base}': {why}; {_SAME_KIND}")
            copies.extend(TensorCopy(f"{donor.prefix}{out}{rest}", s.model, name) for rest, (name, _) in have.items())
            out += 1
    copies += [TensorCopy(n, slices[-1].model, n) for n in layouts[slices[-1].model].others if not embedding(n)]
    _check_others(copies, layouts, donor, base)
    return CopyMap(tuple(slices), tuple(copies))


def _misfit(
    prefix: str, base_prefix: str, layer: int, shapes: Mapping[str, Shape], template: Mapping[str, Shape]
) -> str:
    if prefix != base_prefix:
        return f"its layers are '{prefix}N…', the base's '{base_prefix}N…'"
    if set(shapes) != set(template):
        diff = sorted(set(shapes) ^ set(template))
        return f"{len(diff)} tensor name(s) differ from the base's layers, e.g. '{prefix}{layer}{diff[0]}'"
    rest = next(r for r in template if shapes[r] != template[r])
    return f"'{prefix}{layer}{rest}' has shape {list(shapes[rest])}, the base's {list(template[rest])}"


def _check_others(copies: Sequence[TensorCopy], layouts: Mapping[str, _Layout], donor: _Layout, base: str) -> None:
    """The output's tensors outside the layers must be the base's, with its shapes (its config says them)."""
    outside = {c.output: layouts[c.model].others[c.tensor] for c in copies if c.tensor in layouts[c.model].others}
    missing = sorted(set(donor.others) - set(outside))
    extra = sorted(set(outside) - set(donor.others))
    if missing:
        raise ConfigError(
            f"the output lacks '{missing[0]}', which the base '{base}' has (embeddings come from the first "
            f"slice's model, the other tensors outside the layers from the last's); {_SAME_KIND}"
        )
    source = {c.output: c.model for c in copies}
    if extra:
        raise ConfigError(
            f"the output has '{extra[0]}' (from '{source[extra[0]]}'), which the base '{base}' lacks; {_SAME_KIND}"
        )
    for name, shape in outside.items():
        if shape != donor.others[name]:
            raise ConfigError(
                f"'{name}' of '{source[name]}' has shape {list(shape)}, the base '{base}' "
                f"{list(donor.others[name])}; {_SAME_KIND}"
            )
