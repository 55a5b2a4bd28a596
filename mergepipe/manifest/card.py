"""The model card (``README.md``) of a snapshot: what was merged, how, what it cost, how to redo it.

The card is a pure function of the manifest, so it can name the snapshot id
and the manifest hash, which the hashed file list cannot contain. It is
therefore kept out of that list, and ``verify`` checks it by writing it
again from the manifest: an edited card is reported like an edited file.
The base's own card is never copied: it describes another model.
"""

from __future__ import annotations

import yaml

from mergepipe.manifest.manifest import Manifest
from mergepipe.spec.refs import VERSIONED

#: The card's file name in a snapshot directory.
CARD_FILENAME = "README.md"


def model_card(manifest: Manifest) -> str:
    """The card of the snapshot ``manifest`` describes."""
    m = manifest
    realized, estimated = m.cost.realized, m.cost.estimated
    budget = "none" if m.budget_bytes is None else f"{m.budget_bytes:,} bytes"
    bound = "-" if m.error_bound.estimated is None else f"{m.error_bound.estimated:.6g} ({m.error_bound.kind})"
    settings = {"params": m.operator.params.get("global", {}),
                "expert_params": {_pinned(e): p for e, p in m.operator.params.get("experts", {}).items()}}
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
        "In a catalog with the same block size and the same inputs registered under these ids, with "
        "`params.yml`:",
        "",
        "```yaml",
        yaml.safe_dump(settings, sort_keys=True).rstrip(),
        "```",
        "",
        "```bash",
        f"mergepipe init-db --db CATALOG --block-bytes {m.extra.get('block_bytes', 1 << 20)}",
        f"mergepipe merge --db CATALOG --base {_pinned(m.base.id)} "
        f"--experts {' '.join(_pinned(e.id) for e in m.experts)} "
        f"--operator {m.operator.name} --config params.yml --seed {m.seed} "
        f"--budget {'none' if m.budget_bytes is None else f'{m.budget_bytes}B'} "
        f"--policy {m.extra.get('policy', 'energy')}"
        + (f" --out-dtype {m.extra['out_dtype']}" if m.extra.get("out_dtype") else "")
        + f" --out DIR --model-id {m.model_id.split('@')[0]}",
        "```",
        "",
    ]
    return "\n".join(lines)


def _pinned(model_id: str) -> str:
    """A reference to exactly this version: a stored id without ``@N`` is version 1 of its name, and
    the bare name would mean the latest version by the time someone reruns the command."""
    return model_id if VERSIONED.match(model_id) else f"{model_id}@1"
