"""The fast tier (`scripts/test` without --all) reaches every command and every module.

Which tests are in the tier is pytest's own answer: the items this session collected when
it is the whole fast tier (`scripts/test`), else a `--collect-only` with the tier's marks.
A command is reached when a fast test, or the helpers and constants of its file, spell its
words in a row as string literals, as every test that runs one does (`run_cli("key",
"export", ...)`); a test moved out of the tier no longer counts. A module is reached
when that code imports it or runs it (`-m vault.demo`), or a module so
reached imports it: at load, or inside a function, since the commands import their work
lazily (to start fast) and the first test shows that the tier runs every command.
Imports for type checking only (`if TYPE_CHECKING:`) do not count.
"""

from __future__ import annotations

import ast
import functools
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

import vault
from tests.conftest import ROOT

FAST = "not slow and not crash and not postgres and not openbao and not later_case and not deep"


def runs_the_whole_fast_tier(config: pytest.Config) -> bool:
    """True when this session is the fast tier over the whole suite, unfiltered."""
    opt = config.option
    return (
        config.getoption("markexpr", "") == FAST
        and config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and not (opt.keyword or opt.deselect or opt.ignore or getattr(opt, "lf", False))
    )


Tier = dict[Path, set[str]]  # each file of the fast tier: the names of its fast tests


def tier_of(nodeids: list[str]) -> Tier:
    tier: Tier = {}
    for nodeid in nodeids:
        file, name = nodeid.split("::")[:2]
        tier.setdefault(ROOT / file, set()).add(name.split("[")[0])
    return tier


@pytest.fixture(scope="module")
def fast_tier(request: pytest.FixtureRequest) -> Tier:
    session = request.session
    if runs_the_whole_fast_tier(session.config):
        # A second collection of the whole suite costs as much as the rest of this file.
        return tier_of([item.nodeid for item in session.items])
    return collect_fast_tier()


@functools.cache  # one collection for both tests
def collect_fast_tier() -> Tier:
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_TEST_POSTGRES_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-m", FAST],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tier = tier_of([line for line in proc.stdout.splitlines() if "::" in line])
    assert len(tier) > 20, proc.stdout[-3000:]
    return tier


def fast_code(file: Path, fast: set[str]) -> ast.Module:
    """The file without its tests that are not in the fast tier: what the tier runs of it
    (its helpers and constants, and its fast tests)."""
    tree = ast.parse(file.read_text())
    tree.body = [
        node
        for node in tree.body
        if getattr(node, "name", None) in fast
        or not (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name.startswith("test")
            or isinstance(node, ast.ClassDef)
            and node.name.startswith("Test")
        )
    ]
    return tree


def string_runs(tree: ast.AST) -> list[list[str]]:
    """Every run of string literals in a call's arguments, a list or a tuple."""
    runs = []
    for node in ast.walk(tree):
        elts = node.args if isinstance(node, ast.Call) else getattr(node, "elts", None)
        if not isinstance(node, ast.Call | ast.List | ast.Tuple) or elts is None:
            continue
        run: list[str] = []
        for elt in elts:
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                run.append(elt.value)
            else:
                runs.append(run)
                run = []
        runs.append(run)
    return [r for r in runs if r]


def command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, command in group.commands.items():
        if command.hidden:
            continue
        path = (*prefix, name)
        paths.append(path)
        if isinstance(command, click.Group):
            paths.extend(command_paths(command, path))
    return paths


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    return {
        node
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }


def imports(module: str, tree: ast.Module) -> set[str]:
    """The vault modules `module` imports, anywhere in its code."""
    package = module if module == "vault" else module.rsplit(".", 1)[0]
    skip = type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = package + ("." + base if base else "")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    # Importing `vault.a.b` runs the package `vault.a` first.
    found |= {name.rsplit(".", i)[0] for name in found for i in range(1, name.count(".") + 1)}
    return {name for name in found if name == "vault" or name.startswith("vault.")}


def vault_modules() -> dict[str, ast.Module]:
    out = {"vault": ast.parse((ROOT / "vault" / "__init__.py").read_text())}
    for info in pkgutil.walk_packages(vault.__path__, "vault."):
        path = ROOT / (info.name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / info.name.replace(".", "/") / "__init__.py"
        out[info.name] = ast.parse(path.read_text())
    return out


def test_every_command_is_run_by_a_fast_test(fast_tier: Tier) -> None:
    from vault.cli import cli

    runs = [r for f, fast in fast_tier.items() for r in string_runs(fast_code(f, fast))]
    paths = command_paths(cli)
    assert len(paths) > 20
    missing = [
        " ".join(path)
        for path in paths
        if not any(tuple(r[i : i + len(path)]) == path for r in runs for i in range(len(r)))
    ]
    assert missing == [], f"no fast-tier test runs: {missing}"


def test_every_module_is_loaded_by_a_fast_test(fast_tier: Tier) -> None:
    modules = vault_modules()
    reached: set[str] = set()
    for f, fast in fast_tier.items():
        tree = fast_code(f, fast)
        reached |= imports("tests.x", tree)
        reached |= {r[i + 1] for r in string_runs(tree) for i in range(len(r) - 1) if r[i] == "-m"}
    if "vault" in reached:
        reached.add("vault.__main__")  # `python -m vault`, run_cli
    todo = [m for m in reached if m in modules]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += [m for m in imports(module, modules[module]) if m in modules]
    assert sorted(set(modules) - seen) == []


def test_a_test_moved_out_of_the_fast_tier_no_longer_counts() -> None:
    source = ROOT / "tests" / "scripts" / "test_fast_tier_covers_every_command_and_module.py"
    kept = fast_code(source, {"test_every_command_is_run_by_a_fast_test"})
    names = {getattr(node, "name", "") for node in kept.body}
    assert "test_every_command_is_run_by_a_fast_test" in names
    assert "test_every_module_is_loaded_by_a_fast_test" not in names
    assert "fast_code" in names  # helpers stay: the fast tests use them
