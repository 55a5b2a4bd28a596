"""The copy map of a passthrough (``spec/copy_map.py``), on layouts written here: which source tensor each
output tensor is, the output's config.json, its JSON form, and what does not fit, refused by name."""

from __future__ import annotations

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.copy_map import CopyMap, LayerSlice, build_copy_map


def gpt2(layers: int, width: int = 8) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT-2-style layout: ``wte``/``wpe`` embeddings, layers ``transformer.h.N``, final norm ``ln_f``."""
    out = [("transformer.wte.weight", (50, width)), ("transformer.wpe.weight", (16, width))]
    for i in range(layers):
        out += [(f"transformer.h.{i}.attn.c_attn.weight", (width, 3 * width)), (f"transformer.h.{i}.ln_1.weight",
                                                                                 (width,))]
    return [*out, ("transformer.ln_f.weight", (width,))]


def test_layers_are_stacked_in_order_and_renumbered_with_the_rest_from_the_first_and_last_models():
    copies = build_copy_map([LayerSlice("a", 0, 2), LayerSlice("b", 1, 3), LayerSlice("a", 2, 3)], "a",
                            {"a": gpt2(3), "b": gpt2(4)})
    rows = [(c.output, c.model, c.tensor) for c in copies.copies]
    assert rows[:2] == [("transformer.wte.weight", "a", "transformer.wte.weight"),
                        ("transformer.wpe.weight", "a", "transformer.wpe.weight")]
    layers = {out: (model, tensor) for out, model, tensor in rows if ".h." in out}
    assert len(layers) == 2 * 5 and copies.layers == 5
    assert layers["transformer.h.2.ln_1.weight"] == ("b", "transformer.h.1.ln_1.weight")
    assert layers["transformer.h.3.attn.c_attn.weight"] == ("b", "transformer.h.2.attn.c_attn.weight")
    assert layers["transformer.h.4.ln_1.weight"] == ("a", "transformer.h.2.ln_1.weight")
    assert rows[-1] == ("transformer.ln_f.weight", "a", "transformer.ln_f.weight")  # the last slice's model
    assert copies.models == ("a", "b") and copies.source_layers() == [0, 1, 1, 2, 2]


def test_the_config_gets_the_output_s_layer_count_and_per_layer_lists():
    copies = build_copy_map([LayerSlice("a", 0, 2), LayerSlice("a", 1, 3)], "a", {"a": gpt2(3)})
    assert copies.output_config({"n_layer": 3, "layer_types": ["x", "y", "z"], "vocab_size": 50}) == {
        "n_layer": 4, "layer_types": ["x", "y", "y", "z"], "vocab_size": 50}
    deeper = build_copy_map([LayerSlice("b", 0, 4)], "a", {"a": gpt2(3), "b": gpt2(4)})
    assert deeper.output_config({"num_hidden_layers": 3, "layer_types": ["full"] * 3})["layer_types"] == ["full"] * 4
    with pytest.raises(ConfigError, match="lists layer_types for 3 layers, and a slice takes layer 3"):
        deeper.output_config({"num_hidden_layers": 3, "layer_types": ["x", "y", "z"]})


def test_the_map_reads_back_from_its_json():
    copies = build_copy_map([LayerSlice("a", 1, 3), LayerSlice("b", 0, 1)], "b", {"a": gpt2(3), "b": gpt2(3)})
    assert CopyMap.from_json(copies.to_json()) == copies


@pytest.mark.parametrize("slices, layouts, needle", [
    ([LayerSlice("a", 2, 4)], {"a": gpt2(3)}, "layer_range [2, 4] of 'a': it has 3 layers"),
    ([LayerSlice("b", 0, 1)], {"a": gpt2(2), "b": gpt2(2, width=4)}, "layer 0 of 'b' does not fit the base 'a'"),
    ([LayerSlice("b", 0, 1)], {"a": gpt2(2), "b": [(n.replace(".h.", ".layers."), s) for n, s in gpt2(2)]},
     "its layers are 'transformer.layers.N…', the base's 'transformer.h.N…'"),
    ([LayerSlice("b", 0, 1)], {"a": gpt2(2), "b": gpt2(2)[:-1]}, "the output lacks 'transformer.ln_f.weight'"),
    ([LayerSlice("b", 0, 1)], {"a": gpt2(2), "b": [*gpt2(2), ("lm_head.weight", (50, 8))]},
     "the output has 'lm_head.weight' (from 'b'), which the base 'a' lacks"),
    ([LayerSlice("b", 0, 1)], {"a": gpt2(2), "b": [*gpt2(2), ("vision.blocks.0.w", (2,))]}, "2 stacks of layers"),
])
def test_what_does_not_fit_the_base_is_refused_by_name(slices, layouts, needle):
    with pytest.raises(ConfigError) as info:
        build_copy_map(slices, "a", layouts)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("first, end", [(2, 2), (-1, 2), (0, True)])
def test_a_layer_range_must_be_first_before_end(first, end):
    with pytest.raises(ValueError):
        LayerSlice("a", first, end)
    assert LayerSlice.from_json({"model": "a", "layer_range": [0, 2]}) == LayerSlice("a", 0, 2)
