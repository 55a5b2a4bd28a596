"""The model card (``README.md``) of a snapshot: what was merged, how, what it cost, how to redo it.

The card is a pure function of the manifest, so it can name the snapshot id
and the manifest hash, which the hashed file list cannot contain. It is
therefore kept out of that list, and ``verify`` checks it by writing it
again from the manifest: an edited card is reported like an edited file.
The base's own card is never copied: it describes another model.
"""

from __future__ import annotations

from mergepipe.manifest.config_file import CONFIG_FILENAME, merge_config_yaml
from mergepipe.manifest.manifest import Manifest

#: The card's file name in a snapshot directory.
CARD_FILENAME = "README.md"
#: Files written from the manifest once it is sealed: they name the snapshot, so they stay out of the
#: hashed file list, and ``verify`` checks them by writing them again.
DERIVED_FILENAMES = (CARD_FILENAME, CONFIG_FILENAME)


def derived_files(manifest: Manifest) -> dict[str, str]:
    """``{file name: text}`` of the files a snapshot's manifest determines."""
    return {CARD_FILENAME: model_card(manifest), CONFIG_FILENAME: merge_config_yaml(manifest)}


def model_card(manifest: Manifest) -> str:
    """The card of the snapshot ``manifest`` describes."""
    m = manifest
    realized, estimated = m.cost.realized, m.cost.estimated
    budget = "none" if m.budget_bytes is None else f"{m.budget_bytes:,} bytes"
    bound = "-" if m.error_bound.estimated is None else f"{m.error_bound.estimated:.6g} ({m.error_bound.kind})"
    lines = [
        "---",
        f"base_model: {m.base.id}",
        "tags: [merge, mergepipe]",
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
        *(f"| expert | `{e.id}` | {e.weight:g} | `{e.fingerprint[:16]}` |" for e in m.experts),
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


def _body(config_text: str) -> str:
    """The config without its comment header (the card says the same in prose)."""
    return "\n".join(line for line in config_text.splitlines() if not line.startswith("#"))
