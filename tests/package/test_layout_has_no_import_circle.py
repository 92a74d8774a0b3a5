"""The package's layout rules hold: no import circle, no module over 400 lines.

Every import counts, wherever it stands: at the top, inside a function (the commands
import their work lazily) or under `if TYPE_CHECKING:`. `from vault import crypto`
counts as importing the module `vault.crypto`. Circles are found with Tarjan's
strongly connected components.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

LIMIT = 400


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "vault").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def edges(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of the library that `name` imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = anchor + ("." + base if base else "")
            # `from vault import crypto` names the module vault.crypto, not the package.
            subs = {f"{base}.{a.name}" for a in node.names} & known
            found |= subs if len(subs) == len(node.names) else subs | {base}
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def graph_of(mods: dict[str, Path]) -> dict[str, set[str]]:
    known = set(mods)
    return {n: edges(n, p, known) for n, p in mods.items()}


def test_the_library_has_no_import_circle() -> None:
    graph = graph_of(modules())
    assert len(graph) > 60
    assert circles(graph) == []


def test_a_circle_is_found_when_there_is_one() -> None:
    # The detector itself, on a made-up graph: a -> b -> c -> a, and d alone.
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules().values()
        if (n := len(p.read_text().splitlines())) > LIMIT
    }
    assert long == {}
