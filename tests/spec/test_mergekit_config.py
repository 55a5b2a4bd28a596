"""Reading config files: mergekit's YAML as mergekit means it, MergePipe's own form, refusals by name."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import yaml

from mergepipe.errors import ConfigError
from mergepipe.spec.mergekit import load_config
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


def test_linear_keeps_a_listed_base_among_the_averaged_models():
    # Σ wi Mi / Σ w = B + Σ wi (Ei - B) / Σ w: the base's weight 2 stays in the denominator
    request = _load("""
merge_method: linear
base_model: b
models:
  - {model: b, parameters: {weight: 2.0}}
  - {model: e1, parameters: {weight: 1.0}}
  - {model: e2, parameters: {weight: 1.0}}
""")
    assert request.operator == "linear"
    assert request.base == "b" and request.experts == ("e1", "e2")
    assert request.params == {"base_weight": 2.0}
    assert request.expert_params == {"e1": {"weight": 1.0}, "e2": {"weight": 1.0}}


def test_linear_without_a_base_averages_the_first_model_and_never_calls_it_a_base():
    request = _load("merge_method: linear\nmodels: [{model: a}, {model: c, parameters: {weight: 3}}]")
    assert request.operator == "linear"
    assert request.base == "a" and request.experts == ("c",)
    assert request.params == {"base_weight": 1.0}  # no weight anywhere: MergePipe's default weight, 1
    assert request.expert_params == {"c": {"weight": 3}}
    assert any("the first model 'a'" in n for n in request.notes)
    assert not any("base" in n.replace("base_weight", "") for n in request.notes)


def test_linear_averages_a_base_not_listed_with_the_global_weight_as_mergekit_adds_it():
    request = _load("merge_method: linear\nbase_model: b\nparameters: {weight: [0.2, 0.4]}\n"
                    "models: [{model: e1, parameters: {weight: 1.0}}, {model: e2}]")
    assert request.operator == "linear"
    assert request.base == "b" and request.experts == ("e1", "e2")
    assert request.params == {"weight": [0.2, 0.4], "base_weight": [0.2, 0.4]}
    assert any("not listed under `models:`, is averaged with them as mergekit does" in n for n in request.notes)
    assert _load("merge_method: linear\nbase_model: b\nmodels: [{model: e1}]").params == {"base_weight": 1.0}


@pytest.mark.parametrize("form", ["models", "slices"])
def test_linear_leaves_a_base_out_of_the_average_with_base_weight_0_or_outside_a_slice(form):
    """``base_weight: 0`` (MergePipe's, what mergepipe_config.yml writes for its own linear) is the default, so
    it leaves no trace in the request; a slice's sources are all mergekit averages."""
    if form == "models":
        text = "merge_method: linear\nbase_model: b\nparameters: {base_weight: 0}\nmodels: [{model: e1}, {model: e2}]"
    else:
        text = ("merge_method: linear\nbase_model: b\nslices: [{sources: [{model: e1, layer_range: [0, 4]}, "
                "{model: e2, layer_range: [0, 4]}]}]")
    request = _load(text)
    assert request.base == "b" and request.experts == ("e1", "e2")
    assert request.params == {} and request.expert_params == {}


@pytest.mark.parametrize(("own", "global_", "expected"), [
    # the model's own setting, whatever it is, wins
    ([0, 1], 0.5, [0, 1]),
    ([{"filter": "mlp", "value": 0.2}, {"value": [0, 1]}], None, [{"filter": "mlp", "value": 0.2}, {"value": [0, 1]}]),
    # none of its own: the global weight, then MergePipe's default
    (None, [0.3, 0.6], [0.3, 0.6]),
    (None, None, 1.0),
    # rules that may match no tensor fall back to the global setting, then to the default
    ([{"filter": "mlp", "value": 0.2}], [0.3, 0.6], [{"filter": "mlp", "value": 0.2}, {"value": [0.3, 0.6]}]),
    ([{"filter": "mlp", "value": 0.2}], [{"filter": "attn", "value": 0.4}],
     [{"filter": "mlp", "value": 0.2}, {"filter": "attn", "value": 0.4}, {"value": 1.0}]),
    ({"filter": "mlp", "value": 0.2}, None, [{"filter": "mlp", "value": 0.2}, {"value": 1.0}]),
])
def test_linear_the_first_models_weight_setting_becomes_base_weight(own, global_, expected):
    first = {"model": "a", **({"parameters": {"weight": own}} if own is not None else {})}
    config = {"merge_method": "linear", "models": [first, {"model": "c", "parameters": {"weight": 1.0}}],
              "parameters": {"normalize": False, **({"weight": global_} if global_ is not None else {})}}
    request = _load(yaml.safe_dump(config))
    assert request.params["base_weight"] == expected
    assert request.params["normalize"] is False


@pytest.mark.parametrize(("text", "message"), [
    ("merge_method: linear\nmodels: [{model: a, parameters: {density: 0.5}}, {model: c}]",
     "linear does not take parameter 'density' (the first model 'a')"),
    ("merge_method: linear\nmodels: [{model: a}]", "only one model is listed; linear averages two models or more"),
    ("merge_method: linear\nbase_model: a\nmodels: [{model: a}]", "base_model 'a' is the only model listed"),
    ("merge_method: linear\nmodels: [{model: a}, {model: c}]\nparameters: {base_weight: 2}",
     "base_weight and the weight of the first model 'a' both give its weight"),
])
def test_linear_refusals_name_no_base_the_config_does_not_have(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        _load(text)
    if "base_model" not in text:
        assert "base '" not in str(caught.value) and "the base" not in str(caught.value)


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
    assert request.params == {"filter_wise": False}  # model stock's parameter, its default
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
    ("merge_method: passthrough\nmodels: [{model: e1}, {model: e2}]\n", "passthrough with `models:` copies one model"),
    ("merge_method: frankenmerge\n" + BASE, "unknown merge_method"),
    ("merge_method: linear\nslices: [{sources: []}]\n", "slices"),
    ("merge_method: ties\n" + BASE + "tokenizer_source: union\n", "tokenizer source 'union'"),
    ("merge_method: ties\n" + BASE + "tokenizer: {source: base, tokens: {x: y}}\n", "tokenizer options tokens"),
    ("merge_method: ties\n" + BASE + "chat_template: auto\n", "auto is not supported"),
    ("merge_method: ties\n" + BASE + "chat_template: llama3\n", "not a template MergePipe knows"),
    ("merge_method: ties\nmodels: [{model: e1}]\n", "needs a `base_model`"),
    ("merge_method: ties\nbase_model: b\nmodels: []\n", "non-empty list"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: e1}, {model: e1}]\n", "listed twice"),
    ("merge_method: ties\nbase_model: b\nmodels: [{model: {model: e1, lora: l, revision: x}}]\n", "lora: ADAPTER"),
    ("merge_method: ties\n" + BASE + "mergepipe: {budjet: 1GB}\n", "merge.yml: mergepipe: unknown key 'budjet'"),
    ("merge_method: ties\n" + BASE + "mergepipe: {seed: -1}\n", "seed"),
    ("merge_method: ties\n" + BASE + "weird: 1\n", "unknown key(s) weird"),
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


@pytest.mark.parametrize("method", ["slerp", "model_stock", "nearswap", "arcee_fusion"])
def test_a_weight_mergekit_ignores_is_dropped_with_one_note(method):
    request = _load(f"""
merge_method: {method}
base_model: b
models:
  - {{model: b, parameters: {{weight: 0.3}}}}
  - {{model: e1, parameters: {{weight: [0.2, 0.8], t: 0.1}}}}
  - {{model: e2, parameters: {{weight: 1.0}}}}
parameters: {{weight: 0.5, t: 0.001}}
""")
    assert request.operator == method and request.experts == ("e1", "e2")
    assert request.params == {"t": 0.001}
    assert request.expert_params == {"e1": {"t": 0.1}}  # anything else stays, for validation to judge
    notes = [n for n in request.notes if n.startswith("weight ignored")]
    assert notes == [f"weight ignored: {method} takes no weight (mergekit ignores it too, so the result is the "
                     "same)"]


def test_a_weight_stays_where_the_method_takes_one():
    request = _load("merge_method: ties\nbase_model: b\nmodels: [{model: e1, parameters: {weight: 0.3}}]\n"
                    "parameters: {weight: 0.5}")
    assert request.params == {"weight": 0.5} and request.expert_params == {"e1": {"weight": 0.3}}
    assert not any("weight ignored" in n for n in request.notes)


def test_filter_wise_is_model_stocks_parameter():
    request = _load("merge_method: model_stock\nbase_model: b\nmodels: [{model: e1}, {model: e2}]\n"
                    "parameters: {filter_wise: true}")
    assert request.params == {"filter_wise": True} and request.notes == ()
