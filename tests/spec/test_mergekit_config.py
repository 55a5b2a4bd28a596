"""Reading config files: mergekit's YAML as mergekit means it, MergePipe's own form, refusals by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_config import load_config
from mergepipe.spec.mergekit import CHATML


def _load(text: str) -> SimpleNamespace:
    """The request fields a config file sets, as attributes (unset ones at their empty value)."""
    config = load_config(text, "merge.yml")
    empty = {"base": None, "experts": (), "params": {}, "expert_params": {}, "out_dtype": None,
             "chat_template": None, "notes": ()}
    return SimpleNamespace(form=config.form, **{**empty, **config.fields})


def test_a_ties_config_becomes_base_experts_and_parameters():
    request = _load("""
merge_method: ties
base_model: /m/base
models:
  - model: /m/math
    parameters: {weight: 1.0, density: [0.2, 0.8]}
  - model: /m/code
    parameters:
      weight: [{filter: mlp, value: 0.3}, {value: 0.5}]
      density: 0.4
parameters: {normalize: true, lambda: 0.9}
dtype: bfloat16
""")
    assert request.form == "mergekit"
    assert request.operator == "ties"
    assert request.base == "/m/base"
    assert request.experts == ("/m/math", "/m/code")
    assert request.params == {"normalize": True, "lambda": 0.9}
    assert request.expert_params == {
        "/m/math": {"weight": 1.0, "density": [0.2, 0.8]},
        "/m/code": {"weight": [{"filter": "mlp", "value": 0.3}, {"value": 0.5}], "density": 0.4},
    }
    assert request.out_dtype == "bfloat16"  # no out_dtype: mergekit writes the output in dtype
    assert any("float32" in n for n in request.notes)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_mergekit_rescale_defaults_to_its_l1_meaning(method):
    models = "models: [{model: e1, parameters: {density: 0.5, epsilon: 0.1}}]"
    assert _load(f"merge_method: {method}\nbase_model: b\n{models}").params["rescale"] == "l1"
    assert _load(f"merge_method: {method}\nbase_model: b\n{models}\nparameters: {{rescale: false}}"
                 ).params["rescale"] == "none"
    assert _load(f"merge_method: {method}\nbase_model: b\n{models}\nparameters: {{rescale: true}}"
                 ).params["rescale"] == "l1"


def test_ties_gets_no_rescale():
    request = _load("merge_method: ties\nbase_model: b\nmodels: [{model: e1}]")
    assert "rescale" not in request.params


def test_a_base_listed_among_the_models_is_skipped_for_task_vector_methods():
    request = _load("merge_method: task_arithmetic\nbase_model: b\nmodels: [{model: b}, {model: e1}, {model: e2}]")
    assert request.base == "b" and request.experts == ("e1", "e2")
    assert any("skipped" in n for n in request.notes)


def test_slerp_takes_the_model_that_is_not_the_base():
    request = _load("""
merge_method: slerp
base_model: b
models: [{model: b}, {model: e1}]
parameters:
  t: [{filter: self_attn, value: [0, 1]}, {value: 0.5}]
""")
    assert request.base == "b" and request.experts == ("e1",)
    assert request.params["t"][1] == {"value": 0.5}


def test_linear_folds_a_listed_base_into_the_weights():
    # Σ wi Mi / Σ w = B + Σ (wi / Σ w)(Ei - B): the base's weight 2 stays in the denominator
    request = _load("""
merge_method: linear
base_model: b
models:
  - {model: b, parameters: {weight: 2.0}}
  - {model: e1, parameters: {weight: 1.0}}
  - {model: e2, parameters: {weight: 1.0}}
""")
    assert request.operator == "task_arithmetic"
    assert request.base == "b" and request.experts == ("e1", "e2")
    assert request.params == {"normalize": False}
    assert request.expert_params == {"e1": {"weight": 0.25}, "e2": {"weight": 0.25}}


def test_linear_without_a_base_uses_the_first_model():
    request = _load("merge_method: linear\nmodels: [{model: a}, {model: c, parameters: {weight: 3}}]")
    assert request.operator == "task_arithmetic"
    assert request.base == "a" and request.experts == ("c",)
    assert request.expert_params == {"c": {"weight": 0.75}}
    assert any("first model" in n for n in request.notes)


def test_linear_with_a_base_not_listed_is_the_plain_weighted_mean():
    request = _load("merge_method: linear\nbase_model: b\nmodels: [{model: e1}, {model: e2}]")
    assert request.operator == "linear"
    assert request.base == "b" and request.experts == ("e1", "e2")
    assert request.params == {} and request.expert_params == {}


def test_linear_folding_needs_number_weights():
    with pytest.raises(ConfigError, match="plain-number weights"):
        _load("merge_method: linear\nbase_model: b\nmodels: [{model: b}, {model: e1, parameters: {weight: [0, 1]}}]")


def test_the_mergepipe_section_and_out_dtype():
    request = _load("""
merge_method: model_stock
base_model: b
models: [{model: e1}, {model: e2}]
out_dtype: float16
mergepipe: {budget: 25%, policy: uniform, seed: 7, block_bytes: 64KiB, model_id: merged}
parameters: {filter_wise: false, int8_mask: true}
""")
    assert request.out_dtype == "float16"
    assert (request.budget, request.policy, request.seed, request.block_bytes, request.model_id) == \
        ("25%", "uniform", 7, "64KiB", "merged")
    assert request.params == {}
    assert any("int8_mask" in n for n in request.notes)


def test_chat_templates_by_name_or_text():
    assert _load("merge_method: ties\nbase_model: b\nmodels: [{model: e}]\nchat_template: chatml").chat_template \
        == CHATML
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert _load(f"merge_method: ties\nbase_model: b\nmodels: [{{model: e}}]\nchat_template: \"{text}\""
                 ).chat_template == text


def test_the_own_form_keeps_working():
    request = _load("params: {density: 0.5}\nexpert_params: {e1: {weight: 0.3}}")
    assert request.form == "mergepipe"
    assert request.params == {"density": 0.5} and request.expert_params == {"e1": {"weight": 0.3}}
    assert request.base is None and request.experts == ()


BASE = "base_model: b\nmodels: [{model: e1}]\n"


@pytest.mark.parametrize("text, needle", [
    ("merge_method: passthrough\n" + BASE, "not supported by MergePipe"),
    ("merge_method: frankenmerge\n" + BASE, "unknown merge_method"),
    ("merge_method: linear\nslices: [{sources: []}]\n", "slices"),
    ("merge_method: ties\n" + BASE + "tokenizer_source: union\n", "tokenizer source 'union'"),
    ("merge_method: ties\n" + BASE + "tokenizer: {source: base, tokens: {x: y}}\n", "tokenizer options tokens"),
    ("merge_method: ties\n" + BASE + "chat_template: auto\n", "auto is not supported"),
    ("merge_method: ties\n" + BASE + "chat_template: llama3\n", "not a template MergePipe knows"),
    ("merge_method: ties\nmodels: [{model: e1}]\n", "needs a `base_model`"),
    ("merge_method: ties\nbase_model: b\nmodels: []\n", "non-empty list"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: e1}, {model: e1}]\n", "listed twice"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: {model: e1, lora: l}}]\n", "LoRA"),
    ("merge_method: ties\n" + BASE + "mergepipe: {budjet: 1GB}\n", "unknown key(s) in `mergepipe:`: budjet"),
    ("merge_method: ties\n" + BASE + "mergepipe: {seed: -1}\n", "seed"),
    ("merge_method: ties\n" + BASE + "weird: 1\n", "unknown key(s) weird"),
    ("merge_method: model_stock\n" + BASE + "parameters: {filter_wise: true}\n", "filter_wise"),
    ("params: {density: 0.5}\nmodels: []\n", "unknown key(s) models"),
    ("- a\n- b\n", "expected a mapping"),
    ("merge_method: [ties\n", "not valid YAML"),
])
def test_what_mergepipe_cannot_do_is_refused_by_name(text, needle):
    with pytest.raises(ConfigError) as info:
        _load(text)
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert message.startswith("merge.yml: ")
