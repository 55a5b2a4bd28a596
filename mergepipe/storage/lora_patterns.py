r"""The regular expressions of a PEFT adapter config, compiled once and matched in linear time.

Adapters come from third parties, and each of their patterns (``target_modules``
and ``exclude_modules`` as strings, ``modules_to_save``, the keys of
``rank_pattern`` and ``alpha_pattern``, ``layers_pattern``) runs on every
module path. So each is compiled when the config is read, wrapped as PEFT
wraps it (``lora_config.py`` says which rule uses which): one that Python's
``re`` refuses is refused by its field's name (PEFT could not load the adapter
either), and matching is done by RE2 (``google-re2``), whose time is linear in
the path's length, so that no pattern (``(.*.*)*X``) can stall ``register``.

For the patterns adapters use, RE2 means what ``re`` means. What RE2 cannot
run, or would read otherwise, is refused by name rather than matched
differently: lookbehinds, backreferences, atomic groups, possessive
quantifiers, ``\Z``, verbose mode, ``{,n}`` (text to RE2: write ``{0,n}``)
and POSIX classes (``[[:alpha:]]``, a set of characters to ``re``).
Lookaheads that open a whole-path pattern (LLaMA-Factory writes
``^(?!.*vision_tower).*(?:q_proj|v_proj).*`` as ``target_modules``) are run
apart, each at the start of the path, which is what they mean there. RE2's
``\d``, ``\w``, ``\s`` and ``\b`` are ASCII, as module paths are.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import re2

from mergepipe.errors import CheckpointError, CorruptCheckpointError

# How PEFT wraps a pattern ({} is the pattern as the file has it) before re.match: modules_to_save entries,
# rank_pattern / alpha_pattern keys, layers_pattern entries.
SAVED = r"(^|.*\.){}($|\..*)"
KEY = r"(.*\.)?({})$"
LAYERS = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."
# What RE2 accepts but reads otherwise than Python's re: {,n} (text to RE2), POSIX classes (characters to re).
_READ_OTHERWISE = re.compile(r"\{,\d*\}|\[:\^?[a-z]+:\]")


@dataclass(frozen=True, repr=False)
class PeftRegex:
    """One pattern of the config, compiled as PEFT applies it and matched by RE2.

    ``source`` is the pattern as the file has it (and its repr). ``whole``: the path must match in full
    (PEFT's ``re.fullmatch``), else from its start (``re.match``). ``lookaheads``: the ``(?=…)``/``(?!…)``
    groups that opened a whole-path pattern, as (must match?, body), each tried at the start of the path.
    """

    source: str
    compiled: Any = dataclasses.field(compare=False)
    whole: bool = False
    lookaheads: tuple[tuple[bool, Any], ...] = dataclasses.field(default=(), compare=False)

    def match(self, module: str) -> Any:
        """RE2's match object for ``module``, or None."""
        for wanted, ahead in self.lookaheads:
            if (ahead.match(module) is not None) != wanted:
                return None
        return self.compiled.fullmatch(module) if self.whole else self.compiled.match(module)

    def __repr__(self) -> str:
        return repr(self.source)


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is our one-line error, not a line of RE2's log on stderr
    return options


#: PEFT's rule for a layer index when no layers_pattern is given: the first numbered path segment.
ANY_LAYER = re2.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.", _re2_options())


def peft_regex(path: Path, field: str, source: str, template: str = "{}", whole: bool = False) -> PeftRegex:
    """``source`` from ``field`` of the config at ``path``, wrapped in ``template`` as PEFT wraps it,
    checked by Python's re (which PEFT runs) and compiled for RE2; refused, naming ``field``, where either
    cannot take it."""
    pattern = template.format(source)
    shown = _shown(source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re's FutureWarnings (a "[[" in a class): not for our one line
            re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, re.error) else exc  # re's positions would count PEFT's wrapping
        raise CorruptCheckpointError(
            f"{path}: {field} {shown} is not a valid regular expression ({_first_line(reason)}), so peft "
            f"cannot load this adapter either; correct the pattern in {path.name}"
        ) from None
    odd = _READ_OTHERWISE.search(pattern)
    if odd is not None:
        raise _unmatchable(path, field, shown, f"{odd.group()} means one thing to Python's re and another to RE2")
    lookaheads, rest = _leading_lookaheads(pattern) if whole else ((), pattern)
    options = _re2_options()
    try:
        return PeftRegex(source, re2.compile(rest, options), whole,
                         tuple((wanted, re2.compile(body, options)) for wanted, body in lookaheads))
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise _unmatchable(path, field, shown, f"RE2: {_first_line(reason)}") from None


def _unmatchable(path: Path, field: str, shown: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {field} {shown} cannot be matched in linear time ({reason}); MergePipe matches adapter "
        "patterns with RE2 so that no pattern can stall it (no lookbehinds or backreferences; lookaheads only "
        "at the start of a target_modules or exclude_modules string): rewrite the pattern, or merge the "
        "adapter into its base with peft's merge_and_unload() and register the result"
    )


def _leading_lookaheads(pattern: str) -> tuple[tuple[tuple[bool, str], ...], str]:
    """``^(?!A)(?=B)REST`` as ``((False, "A"), (True, "B"))`` and ``REST``: in a whole-path match, a
    lookahead that opens the pattern means "its body matches (or not) from the start of the path". Any
    other pattern, or one whose top level has a ``|`` (the lookaheads would open its first branch only),
    comes back whole."""
    at = 1 if pattern.startswith("^") else 0
    found = []
    while pattern.startswith(("(?=", "(?!"), at):
        end = next((i for i, char, depth in _structure(pattern, at) if char == ")" and depth == 0), None)
        if end is None:  # a (?#comment) holding a parenthesis: RE2 refuses the whole pattern
            return (), pattern
        found.append((pattern[at + 2] == "=", pattern[at + 3:end]))
        at = end + 1
    rest = pattern[at:]
    if not found or rest.startswith(("*", "+", "?", "{")) or any(
            char == "|" and depth == 0 for _, char, depth in _structure(rest, 0)):
        return (), pattern
    return tuple(found), rest


def _structure(pattern: str, start: int) -> Iterator[tuple[int, str, int]]:
    """``(index, char, depth)`` of each character of ``pattern`` from ``start`` outside escapes and
    character classes; depth counts the groups open after it (a ``)`` has the depth it closes to)."""
    depth, at = 0, start
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            at += 2
            continue
        if char == "[":
            at += 2 if pattern.startswith("[^", at) else 1
            at += pattern.startswith("]", at)  # a ] first in a class is a character
            while at < len(pattern) and pattern[at] != "]":
                at += 2 if pattern[at] == "\\" else 1
            at += 1
            continue
        depth += (char == "(") - (char == ")")
        yield at, char, depth
        at += 1


def _shown(source: str) -> str:
    """A pattern for a one-line message: its repr, cut short."""
    text = repr(source)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_line(value: Any) -> str:
    lines = str(value).splitlines()
    return lines[0] if lines else ""
