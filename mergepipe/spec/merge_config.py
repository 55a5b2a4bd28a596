"""Read a merge config file: MergePipe's own form or mergekit's, told apart by ``merge_method``."""

from __future__ import annotations

import yaml

from mergepipe.errors import ConfigError
from mergepipe.spec.merge_request import MergeRequest, own_form
from mergepipe.spec.mergekit import from_mergekit


def load_config(text: str, source: str) -> MergeRequest:
    """Parse a config file's ``text`` (``source`` names it in errors)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    if "merge_method" in data:
        return from_mergekit(data, source)
    return own_form(data, source)
