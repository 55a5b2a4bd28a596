"""The model card (``README.md``) of a snapshot: what was merged, how, what it cost, how to redo it.

The card is a pure function of the manifest, so it can name the snapshot id
and the manifest hash, which the hashed file list cannot contain. It is
therefore kept out of that list, and ``verify`` checks it by writing it
again from the manifest: an edited card is reported like an edited file.
Only this release's text can be written again, so the manifest records
which text its card and config file have (``extra.card_format``,
``CARD_FORMAT``); a snapshot with another (an earlier MergePipe's, or none
recorded) has its card and config file checked for naming the snapshot,
and ``verify`` says that it could not check more.
The base's own card is never copied: it describes another model.

Its front matter is the Hub's model-card metadata for a merge, from which
the Hub draws the model tree: ``base_model`` lists the models merged, the
base first, as people know them (the manifest's ``extra.base_name`` and
``extra.expert_names``: a Hub id or the folder's name; the catalog's id means
nothing outside the catalog, and names an expert only where it is its
folder's name too), with ``base_model_relation: merge``. Each expert's weight
is shown as the merge stated it, a gradient or filter rules included, not as
the one number a manifest's ``experts`` entry holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mergepipe.manifest.config_file import CONFIG_FILENAME, merge_config_yaml
from mergepipe.manifest.manifest import Manifest
from mergepipe.storage.checkpoint import CARD_FILENAME

#: The text ``derived_files`` writes, recorded in each manifest's ``extra.card_format``: raised with any change
#: to the card's or config file's text, so that ``verify`` re-creates only the snapshots of this one (1: the
#: manifests before it was recorded, whose cards earlier releases wrote).
CARD_FORMAT = 2


def derived_files(manifest: Manifest) -> dict[str, str]:
    """``{file name: text}`` of the files a snapshot's manifest determines."""
    return {CARD_FILENAME: model_card(manifest), CONFIG_FILENAME: merge_config_yaml(manifest)}


def card_format(manifest: Manifest) -> int:
    """The format of the snapshot's card and config file (``CARD_FORMAT``: those ``derived_files`` writes)."""
    value = manifest.extra.get("card_format", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def as_written(manifest: Manifest, text: str | None, written: str) -> bool:
    """Whether ``text`` (a derived file's, None when unreadable) is what MergePipe wrote for the snapshot, whose
    ``derived_files`` text is ``written``: exactly that, for a card of ``CARD_FORMAT``; for an earlier one, a text
    naming the snapshot (this release cannot write that text again)."""
    if text is None:
        return False
    return text == written if card_format(manifest) == CARD_FORMAT else manifest.snapshot_id in text


def read_text(path: Path) -> str | None:
    """A derived file's text; None when it cannot be read as UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def model_card(manifest: Manifest) -> str:
    """The card of the snapshot ``manifest`` describes."""
    m = manifest
    realized, estimated = m.cost.realized, m.cost.estimated
    budget = "none" if m.budget_bytes is None else f"{m.budget_bytes:,} bytes"
    if m.extra.get("budget") and m.budget_bytes is not None:
        budget = f"{m.extra['budget']} ({budget})"
    bound = "-" if m.error_bound.estimated is None else f"{m.error_bound.estimated:.6g} ({m.error_bound.kind})"
    front = {"base_model": merged_models(m), "base_model_relation": "merge", "library_name": "transformers",
             "tags": ["merge", "mergepipe"]}
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False, allow_unicode=True, default_flow_style=None, width=1 << 16).rstrip(),
        "---",
        f"# {m.model_id}",
        "",
        f"A merge of `{m.base.id}` with {len(m.experts)} expert(s) by **{m.operator.name}**, made by MergePipe "
        f"{m.software.mergepipe}. Check the files with `mergepipe verify DIR`.",
        "",
        "| | |",
        "|---|---|",
        f"| snapshot | `{m.snapshot_id}` |",
        f"| manifest hash | `{m.manifest_hash}` |",
        f"| plan digest | `{m.plan_digest}` |",
        f"| operator | {m.operator.name}, seed {m.seed} |",
        f"| expert-I/O budget | {budget} |",
        f"| expert bytes | {estimated.expert_bytes:,} planned, {realized.expert_bytes:,} read |",
        f"| error bound vs the full-read merge | {bound} |",
        f"| output dtype, policy | {m.extra.get('out_dtype') or 'as the base'}, {m.extra.get('policy', '-')} |",
        "",
        "## Inputs",
        "",
        "| role | model | weight | content fingerprint |",
        "|---|---|---|---|",
        f"| base | `{m.base.id}` | | `{m.base.fingerprint[:16]}` |",
        *(f"| expert | `{e.id}` | {_weight(m, e.id, e.weight)} | `{e.fingerprint[:16]}` |" for e in m.experts),
        "",
        "## Reproduce",
        "",
        f"`{CONFIG_FILENAME}` beside this card states the merge as a mergekit-style config (the `model:` "
        "entries are catalog ids of the exact versions merged):",
        "",
        "```yaml",
        _body(merge_config_yaml(m)).rstrip(),
        "```",
        "",
        "In a catalog with these inputs registered under these ids:",
        "",
        "```bash",
        f"mergepipe merge --db CATALOG --config {CONFIG_FILENAME} --out DIR",
        "```",
        "",
    ]
    return "\n".join(lines)


def merged_models(manifest: Manifest) -> list[str]:
    """The models merged, as people know them: the base, then each expert, each name once."""
    names: dict[str, str] = manifest.extra.get("expert_names", {})
    models = [manifest.extra.get("base_name") or manifest.base.id, *(names.get(e.id, e.id) for e in manifest.experts)]
    return list(dict.fromkeys(models))


def _body(config_text: str) -> str:
    """The config without its comment header (the card says the same in prose)."""
    return "\n".join(line for line in config_text.splitlines() if not line.startswith("#"))


def _weight(m: Manifest, expert_id: str, number: float) -> str:
    """The expert's ``weight`` as the merge stated it (its own, else the global one): a number, a gradient
    or filter rules in YAML's flow style; ``number`` (the manifest's) when the merge stated none."""
    params = m.operator.params
    own: dict[str, Any] = params.get("experts", {}).get(expert_id, {})
    value = own.get("weight", params.get("global", {}).get("weight"))
    if value is None:
        return f"{number:g}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip().replace("|", "\\|")  # a bar would end the table's cell
