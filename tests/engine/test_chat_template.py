"""``Plan.chat_template``: the output's tokenizer_config.json is the base's with ``chat_template`` set.

Expectations are built with the json module from the base's own file: every
other key equal and in the base's order, the text as ``json.dumps(indent=2,
ensure_ascii=False)`` writes it plus a newline; transformers reads a
``chat_template.jinja`` before the config's entry, so a base that has one
gets the template there too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.errors import ConfigError, ModelChangedError
from mergepipe.planner.planner import Planner
from mergepipe.spec.plan import Plan
from mergepipe.txn.verify import verify_snapshot
from mergepipe.spec.request import MergeRequest
from tests.planner.support import build_catalog

BLOCK_BYTES = 4096
TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %} ← ünïcode")
#: a tokenizer config whose key order is not sorted, with non-ASCII text and nested values
TOKENIZER_CONFIG = {
    "model_max_length": 128,
    "bos_token": "<s>",
    "added_tokens_decoder": {"0": {"content": "<unk>", "special": True}},
    "chat_template": "{{ old }}",
    "eos_token": "</s>",
    "clean_up_tokenization_spaces": False,
    "name": "Modèle «base»",
}


def copy_base(source: Path, target: Path, tokenizer_config: dict | None, jinja: str | None = None) -> Path:
    """The tiny base's files, with ``tokenizer_config`` (None: no such file) and a chat_template.jinja."""
    shutil.copytree(source, target)
    config = target / "tokenizer_config.json"
    if tokenizer_config is None:
        config.unlink()
    else:
        config.write_text(json.dumps(tokenizer_config, indent=4), encoding="utf-8")  # not how MergePipe writes it
    if jinja is not None:
        (target / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return target


def catalog_for(tmp_path: Path, tiny_family, base: Path) -> Catalog:
    db = build_catalog(tmp_path / "c.db", BLOCK_BYTES, {"base": base, "e1": tiny_family["e1"],
                                                        "e2": tiny_family["e2"]}, base="base", experts=["e1", "e2"])
    return Catalog.open(db)


def plan_and_merge(catalog: Catalog, out: Path, **options) -> Plan:
    plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", budget="50%", **options))
    Engine(catalog).execute(plan, out=out, model_id=out.name)
    return plan


WITHOUT_TEMPLATE = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}


@pytest.mark.parametrize("config", [TOKENIZER_CONFIG, WITHOUT_TEMPLATE], ids=["replaces", "adds"])
def test_the_template_is_set_and_every_other_key_kept_in_order(tiny_family, tmp_path, config):
    base = copy_base(tiny_family["base"], tmp_path / "base", config)
    with catalog_for(tmp_path, tiny_family, base) as catalog:
        plan = plan_and_merge(catalog, tmp_path / "out", chat_template=TEMPLATE)
    assert plan.chat_template == TEMPLATE and plan.to_json()["chat_template"] == TEMPLATE
    text = (tmp_path / "out" / "tokenizer_config.json").read_text(encoding="utf-8")
    written = json.loads(text)
    assert written["chat_template"] == TEMPLATE
    assert {k: v for k, v in written.items() if k != "chat_template"} == {
        k: v for k, v in config.items() if k != "chat_template"}
    expected_order = list(config) if "chat_template" in config else [*config, "chat_template"]
    assert list(written) == expected_order
    assert text == json.dumps({**config, "chat_template": TEMPLATE}, indent=2, ensure_ascii=False) + "\n"
    assert "ünïcode" in text and "«base»" in text  # not escaped
    report = verify_snapshot(tmp_path / "out")
    assert report.ok, report.problems
    assert not (tmp_path / "out" / "chat_template.jinja").exists()
    # the other side files are the base's, as they are
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (base / name).read_bytes()


def test_without_a_template_the_tokenizer_config_is_copied_as_it_is(tiny_family, tmp_path):
    base = copy_base(tiny_family["base"], tmp_path / "base", TOKENIZER_CONFIG, jinja="{{ base }}")
    with catalog_for(tmp_path, tiny_family, base) as catalog:
        plain = plan_and_merge(catalog, tmp_path / "plain")
        templated = plan_and_merge(catalog, tmp_path / "templated", chat_template=TEMPLATE)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "plain" / name).read_bytes() == (base / name).read_bytes()
    assert "chat_template" not in plain.to_json() and plain.digest != templated.digest
    # the same weights: a template changes the tokenizer files only
    assert (tmp_path / "plain" / "model.safetensors").read_bytes() == (
        tmp_path / "templated" / "model.safetensors").read_bytes()


def test_a_base_chat_template_file_gets_the_template_too(tiny_family, tmp_path):
    """transformers reads chat_template.jinja in preference to tokenizer_config.json's entry."""
    base = copy_base(tiny_family["base"], tmp_path / "base", TOKENIZER_CONFIG, jinja="{{ base template }}\n")
    with catalog_for(tmp_path, tiny_family, base) as catalog:
        plan_and_merge(catalog, tmp_path / "out", chat_template=TEMPLATE)
    assert (tmp_path / "out" / "chat_template.jinja").read_text(encoding="utf-8") == TEMPLATE
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert verify_snapshot(tmp_path / "out").ok


def test_a_base_without_a_tokenizer_config_is_refused_before_anything_is_written(tiny_family, tmp_path):
    base = copy_base(tiny_family["base"], tmp_path / "base", None)
    with catalog_for(tmp_path, tiny_family, base) as catalog:
        with pytest.raises(ConfigError, match="tokenizer_config.json"):
            Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", chat_template=TEMPLATE))
        assert catalog.snapshots.list() == []
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("c.db")) == ["base"]


@pytest.mark.parametrize("template", ["", "   ", 5])
def test_an_empty_template_is_refused(tiny_family, tmp_path, template):
    with catalog_for(tmp_path, tiny_family, tiny_family["base"]) as catalog:
        with pytest.raises(ConfigError, match="chat.template"):
            Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", chat_template=template))


def test_a_tokenizer_config_removed_after_planning_is_refused_and_nothing_published(tiny_family, tmp_path):
    base = copy_base(tiny_family["base"], tmp_path / "base", TOKENIZER_CONFIG)
    with catalog_for(tmp_path, tiny_family, base) as catalog:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=["e1", "e2"], operator="task_arithmetic", chat_template=TEMPLATE))
        (base / "tokenizer_config.json").unlink()
        with pytest.raises(ModelChangedError, match="tokenizer_config.json"):
            Engine(catalog).execute(plan, out=tmp_path / "out", model_id="m")
        assert [s.status for s in catalog.snapshots.list()] == ["aborted"]
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("c.db")) == ["base"]
