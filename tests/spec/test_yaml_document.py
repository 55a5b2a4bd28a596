"""``yaml_document``, the one way a config's YAML is read (``merge --config`` and ``integrate``'s recipe): what a
broken or hostile file makes the parser raise is one ``ConfigError`` naming the file, and what loads is bounded
in depth and in values (aliases counted at every use), so that nothing after it recurses or loops on it."""

from __future__ import annotations

import pytest

from mergepipe.errors import ConfigError
from mergepipe.spec.mergekit import MAX_DEPTH, MAX_VALUES, load_config, yaml_document


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def _laughs(levels: int, width: int = 10) -> str:
    """Each level an anchored list of ``width`` aliases of the one below: width**levels values once expanded."""
    lines = [f"l0: &l0 [{', '.join(['1'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("content, words", [
    (f"a: {_nested(10_000)}", "nested too deeply to read"),
    (_nested(MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels deep"),
    ("a: &x [*x]", f"nested more than {MAX_DEPTH} levels deep"),  # an alias inside its own anchor
    (f"a: &a {_nested(40)}\nb: {'[' * 40}*a{']' * 40}", f"nested more than {MAX_DEPTH} levels deep"),
    (_laughs(6), f"more than {MAX_VALUES}"),
    (b"a: 1\nb: caf\xe9\n", "not UTF-8 text (line 2 has the byte 0xe9); save it as UTF-8"),
    ("seed: " + "9" * 5000, "value has 5000 digits"),
    ("when: 2024-13-01", "month must be in 1..12"),
    ("a: 1\n---\nb: 2\n", "not valid YAML (expected a single document in the stream)"),
    ("a: !!python/object/apply:os.system [ls]", "not valid YAML (could not determine a constructor"),
    ("a: [1, 2", "not valid YAML"),
])
def test_a_hostile_or_broken_file_is_one_config_error_naming_it(content, words):
    with pytest.raises(ConfigError) as info:
        yaml_document(content if isinstance(content, bytes) else content.encode(), "dir/merge.yml")
    message = str(info.value)
    assert message.startswith("dir/merge.yml: ") and words in message and "\n" not in message


def test_what_a_config_may_hold_loads():
    assert yaml_document(_nested(MAX_DEPTH).encode(), "f") == yaml_document(_nested(MAX_DEPTH), "f")
    assert yaml_document(_laughs(4).encode(), "f")["l3"][0][0][0] == [1] * 10  # 10**4 values: shared, allowed
    assert yaml_document(b"\xef\xbb\xbfa: 1\n", "f") == {"a": 1}  # a byte-order mark, as editors write it
    assert yaml_document(b"", "f") is None


def test_load_config_reads_bytes_as_text():
    text = "merge_method: linear\nmodels:\n  - model: a\n    parameters: {weight: 0.5}\n  - model: b\n"
    assert load_config(text.encode(), "m.yml") == load_config(text, "m.yml")
