"""The package's structure keeps the promises of docs/ARCHITECTURE.md.

The layer order is read from that document's "Layers" block, so the map and
the code cannot drift apart: every import (module level, function level or
under TYPE_CHECKING, parsed with ``ast``) must point down the layers or stay
inside its own package; peers on one layer never import each other; the
module graph has no cycle; and no ``mergepipe`` import hides inside a function.
(Size is not capped here: a module holds one idea, whatever its length;
hard line caps made twelve-parameter helpers.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mergepipe"
DOC = REPO / "docs" / "ARCHITECTURE.md"


def layer_ranks() -> dict[str, int]:
    """Top-level unit (``spec``, ``errors``, ``mergepipe`` for the package root)
    -> rank, higher = nearer the top, from the doc's fenced block after "## Layers"."""
    text = DOC.read_text()
    match = re.search(r"^## Layers\b.*?```[a-z]*\n(.*?)```", text, re.S | re.M)
    assert match, f"{DOC} has no fenced block under '## Layers'"
    lines = [line.strip() for line in match.group(1).splitlines() if line.strip()]
    ranks = {}
    for rank, line in enumerate(reversed(lines)):
        for name in line.split("|"):
            ranks[name.strip()] = rank
    return ranks


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer unit of a module: its top-level package or module under mergepipe."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mergepipe"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported mergepipe module, line, at module level)`` for every import in ``path``.

    ``from mergepipe.pkg import name`` imports the package ``mergepipe.pkg`` (its ``__init__`` runs, and
    ``name`` may be an attribute it defines) and, where ``name`` is a module, that module too: both are
    edges, so a cycle through a package's ``__init__`` shows. ``import_module("mergepipe.x")`` (a literal,
    or an f-string's literal head) is an import too, where it runs: it is a lazy import, allowed inside a
    function, and checked for layers and cycles like any other (``lazy=True`` in the third field)."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports under a top-level `if TYPE_CHECKING:` are module level too
        if isinstance(node, ast.If):
            top_level.update(id(child) for child in node.body)
    here = module_name(path) if path.is_relative_to(REPO) else ""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from mergepipe.spec import fields` imports the package and the module mergepipe.spec.canonical
            names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            if node.module != here:
                names.append(node.module)
        elif _lazy_target(node) is not None:
            out.append((_lazy_target(node), node.lineno, True))
            continue
        else:
            continue
        for name in dict.fromkeys(names):
            if name == "mergepipe" or name.startswith("mergepipe."):
                out.append((name, node.lineno, id(node) in top_level))
    return out


def _lazy_target(node: ast.AST) -> str | None:
    """The mergepipe module an ``import_module(...)`` call names (its literal head), or None."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "import_module"
            and node.args):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = arg.value
    elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        text = str(arg.values[0].value).rstrip(".")
    else:
        return None
    return text if text == "mergepipe" or text.startswith("mergepipe.") else None


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, _, _ in imports(path, known):
            while target not in known:  # `import mergepipe.x.y` of a non-module attribute
                target = target.rsplit(".", 1)[0]
            if target != name:
                edges[name].add(target)
    return edges


def test_the_doc_names_every_unit_of_the_package():
    ranks = layer_ranks()
    units = {unit_of(m) for m in modules()}
    assert units <= set(ranks), f"units missing from the Layers block of {DOC}: {sorted(units - set(ranks))}"


def test_imports_point_down_the_layers():
    ranks = layer_ranks()
    mods = modules()
    wrong = []
    for name, path in mods.items():
        for target, line, _ in imports(path, set(mods)):
            src, dst = unit_of(name), unit_of(target)
            if src == dst:
                continue
            if ranks[dst] >= ranks[src]:
                wrong.append(f"{path.relative_to(REPO)}:{line} {src} -> {dst}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_mergepipe_import_inside_a_function():
    mods = modules()
    hidden = [
        f"{path.relative_to(REPO)}:{line} {target}"
        for path in mods.values()
        for target, line, top in imports(path, set(mods))
        if not top
    ]
    assert not hidden, "function-local imports (they hide cycles and layer breaks):\n" + "\n".join(hidden)


def test_a_layer_break_is_caught(tmp_path):
    """The checker itself: an upward import in a parsed module is reported, a package's __init__ is an
    import of its own, and import_module of a mergepipe module is an import."""
    module = tmp_path / "probe.py"
    module.write_text("from mergepipe.engine.engine import Engine\nfrom mergepipe.catalog import schema\n\n"
                      "def f():\n    import mergepipe.cli\n    import_module('mergepipe.app.merging')\n"
                      "    import_module(f'mergepipe.cli.{name}')\n")
    found = imports(module, set(modules()))
    assert ("mergepipe.engine.engine", 1, True) in found
    assert {("mergepipe.catalog.schema", 2, True), ("mergepipe.catalog", 2, True)} <= set(found)
    assert ("mergepipe.cli", 5, False) in found
    assert ("mergepipe.app.merging", 6, True) in found and ("mergepipe.cli", 7, True) in found
