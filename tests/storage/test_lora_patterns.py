"""The patterns of ``adapter_config.json`` (``storage/lora.py``): the modules a config selects, and
each module's rank and alpha, are peft's own answers (its ``check_target_module_exists`` and
``get_pattern_key`` on the same config), while matching runs in RE2; patterns RE2 would run otherwise, or not
at all, are refused by field; a pattern that stalls Python's re is decided at once."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest

from mergepipe.errors import CheckpointError, CorruptCheckpointError
from mergepipe.storage.lora import read_adapter_config

peft = pytest.importorskip("peft")
from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists  # noqa: E402
from peft.utils.other import get_pattern_key  # noqa: E402

MODULES = [
    "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.12.mlp.down_proj",
    "model.vision_tower.layers.0.q_proj", "model.embed_tokens", "lm_head", "model.layers.1.experts.3.up_proj",
    "visual.blocks.0.attn.qkv", "model.h.2.attn.c_attn", "q_proj",
]
CONFIGS = {
    "llama-factory": dict(target_modules=r"^(?!.*vision_tower).*(?:q_proj|v_proj).*"),
    "two-lookaheads": dict(target_modules=r"^(?!.*visual)(?=.*layers).*(?:q_proj|up_proj|qkv)"),
    "regex": dict(target_modules=r".*\.(q_proj|down_proj)"),
    "layers": dict(target_modules=["q_proj", "up_proj"], layers_to_transform=[1], layers_pattern="layers"),
    "layers-patterns": dict(target_modules=["q_proj", "up_proj", "c_attn"], layers_to_transform=2,
                            layers_pattern=["layers", "h"]),
    "any-layer": dict(target_modules=["q_proj", "up_proj"], layers_to_transform=[0, 1]),
    "exclude-regex": dict(target_modules=["q_proj", "v_proj"], exclude_modules=r".*layers\.1\..*"),
    "exclude-list-and-saved": dict(target_modules=r".*proj", exclude_modules=["down_proj"],
                                   modules_to_save=["lm_head", "embed_tokens"]),
    "saved-regex": dict(target_modules=r".*", modules_to_save=[r"layers\.1"]),
    "rank-alpha": dict(target_modules=["q_proj"], rank_pattern={"down_proj": 6, r"layers\.1\..*": 2, "q_proj": 3},
                       alpha_pattern={r"self_attn\.(q|v)_proj": 5, "^model": 7, "lm_head": 9}),
}


def _saved(tmp_path: Path, **fields) -> Path:
    config = peft.LoraConfig(r=4, lora_alpha=8, **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config.save_pretrained(str(tmp_path))
    return tmp_path


def _written(tmp_path: Path, **fields) -> Path:
    doc = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **fields}
    (tmp_path / "adapter_config.json").write_text(json.dumps(doc))
    return tmp_path


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_selection_rank_and_alpha_are_peft_s(tmp_path, case):
    config = peft.LoraConfig(r=4, lora_alpha=8, **CONFIGS[case])
    ours = read_adapter_config(_saved(tmp_path, **CONFIGS[case]))
    ranks, alphas = config.rank_pattern or {}, config.alpha_pattern or {}
    for module in MODULES:
        found = check_target_module_exists(config, module)
        assert ours.targets(module) == (bool(found) and not isinstance(found, _ExcludedModule)), module
        assert ours.rank_of(module) == ranks.get(get_pattern_key(list(ranks), module), 4), module
        assert ours.alpha_of(module) == alphas.get(get_pattern_key(list(alphas), module), 8), module


@pytest.mark.parametrize("field, value", [
    ("target_modules", "(q_proj"), ("exclude_modules", "[q"), ("modules_to_save", ["lm_head)"]),
    ("rank_pattern", {"*q": 2}), ("alpha_pattern", {"q{2": 2, "(?P<": 3}), ("layers_pattern", ["(("]),
    ("target_modules", "(" * 5000 + ")" * 5000), ("target_modules", "a{99999999999}"),
])
def test_an_invalid_pattern_is_corrupt_and_named(tmp_path, field, value):
    with pytest.raises(CorruptCheckpointError, match=f"{field} .* is not a valid regular expression") as info:
        read_adapter_config(_written(tmp_path, **{field: value}))
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize("field, value, reason", [
    ("target_modules", r"(?<=attn\.)q_proj", "RE2: invalid perl operator: (?<"),
    ("exclude_modules", r"(q)_\1", r"RE2: invalid escape sequence: \1"),
    ("rank_pattern", {"(?!x)q_proj": 2}, "RE2: invalid perl operator: (?!"),
    ("target_modules", r"^(?!.*vision).*q_proj|v_proj", "RE2: invalid perl operator: (?!"),
    ("alpha_pattern", {"q{,2}": 2}, "{,2} means one thing to Python's re and another to RE2"),
    ("modules_to_save", ["[[:alpha:]]+"], "[:alpha:] means one thing"),
])
def test_a_pattern_re2_would_run_otherwise_is_refused_by_name(tmp_path, field, value, reason):
    with pytest.raises(CheckpointError, match=f"{field} .* cannot be matched in linear time") as info:
        read_adapter_config(_written(tmp_path, **{field: value}))
    assert reason in str(info.value) and "\n" not in str(info.value)


def test_a_stalling_pattern_is_matched_in_linear_time(tmp_path):
    """``(.*.*)*X`` backtracks for hours in Python's re on a 50-character path; RE2 decides a long one at once."""
    config = read_adapter_config(_written(tmp_path, target_modules="(.*.*)*X", rank_pattern={"(a|a)*b": 2},
                                          modules_to_save=["(x+x+)+y"]))
    path = "model." * 20_000 + "q_proj"
    started = time.perf_counter()
    assert not config.targets(path) and config.rank_of(path) == 4
    assert time.perf_counter() - started < 5
