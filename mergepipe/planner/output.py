"""What a plan says about the output folder besides the weights' values: its shard size, chat template,
whether it gets the base's tokenizer, and the base's side files it gets.

All change the output's bytes, so all are part of the plan (``Plan.out_shard_bytes``,
``Plan.chat_template``, ``Plan.copy_tokenizer``, in its digest only when not the default) and are checked
here, when the plan is made, not when the engine is halfway through writing.
"""

from __future__ import annotations

from typing import Any

from mergepipe.catalog.records import ModelRecord
from mergepipe.errors import ConfigError
from mergepipe.storage.checkpoint import TOKENIZER_CONFIG_FILE
from mergepipe.storage.location import location
from mergepipe.storage.remote import is_file


def output_options(base: ModelRecord, out_shard_bytes: int | None, chat_template: str | None,
                   copy_tokenizer: bool = True) -> dict[str, Any]:
    """The plan fields ``out_shard_bytes``, ``chat_template``, ``copy_tokenizer`` and ``side_files`` (the
    base's, recorded at registration; the engine copies them, checked), checked; ConfigError naming the fix.

    Any shard size of at least one byte has a well-defined packing (a tensor larger than it sits alone in
    its shard), so 1 is the minimum: a floor such as 1 MiB would refuse nothing harmful and would forbid
    sharding small models. A chat template is written into the base's tokenizer_config.json, so the base
    must have one; the catalog records weight files only, so its folder is looked at (a stat, no read).
    """
    if out_shard_bytes is not None and (isinstance(out_shard_bytes, bool) or not isinstance(out_shard_bytes, int)
                                        or out_shard_bytes < 1):
        raise ConfigError(f"the output shard size must be a whole number of bytes, at least 1 (e.g. 5GB), got "
                          f"{out_shard_bytes!r}")
    if chat_template is not None and not copy_tokenizer:
        raise ConfigError("a chat template is written into the output's tokenizer files, which "
                          "--no-copy-tokenizer leaves out; keep the tokenizer, or drop chat_template")
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ConfigError("the chat template must be the non-empty text of a Jinja template")
        if not is_file(location(base.uri) / TOKENIZER_CONFIG_FILE):  # a local stat, or a HEAD for a remote base
            raise ConfigError(
                f"a chat template is written into the base's {TOKENIZER_CONFIG_FILE}, and base '{base.id}' "
                f"({base.uri}) has none; give a base with tokenizer files, or merge without a chat template"
            )
    return {"out_shard_bytes": out_shard_bytes, "chat_template": chat_template, "copy_tokenizer": copy_tokenizer,
            "side_files": base.side_digests}
