"""The fast tier (`scripts/test` without --all) reaches every command and every module.

Which files are in the tier is pytest's own answer: the items this session collected when
it is the whole fast tier (`scripts/test`), else a `--collect-only` with the tier's marks.
A command is reached when a file of the tier spells its words in a row as string
literals, as every test that runs one does (`run_cli("key", "export", ...)`). A module is
reached when a file of the tier imports it or runs it (`-m vault.demo`), or a module so
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

FAST = "not slow and not crash and not postgres"


def runs_the_whole_fast_tier(config: pytest.Config) -> bool:
    """True when this session is the fast tier over the whole suite, unfiltered."""
    opt = config.option
    return (
        config.getoption("markexpr", "") == FAST
        and config.args_source is pytest.Config.ArgsSource.TESTPATHS
        and not (opt.keyword or opt.deselect or opt.ignore or getattr(opt, "lf", False))
    )


@pytest.fixture(scope="module")
def fast_files(request: pytest.FixtureRequest) -> list[Path]:
    session = request.session
    if runs_the_whole_fast_tier(session.config):
        # A second collection of the whole suite costs as much as the rest of this file.
        return sorted({ROOT / item.nodeid.split("::")[0] for item in session.items})
    return collect_fast_tier()


@functools.cache  # one collection for both tests
def collect_fast_tier() -> list[Path]:
    env = {k: v for k, v in os.environ.items() if k != "MEMVAULT_TEST_POSTGRES_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-m", FAST],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert len(files) > 20, proc.stdout[-3000:]
    return sorted(ROOT / f for f in files)


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
    return {name for name in found if name == "vault" or name.startswith("vault.")}


def vault_modules() -> dict[str, ast.Module]:
    out = {"vault": ast.parse((ROOT / "vault" / "__init__.py").read_text())}
    for info in pkgutil.walk_packages(vault.__path__, "vault."):
        path = ROOT / (info.name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / info.name.replace(".", "/") / "__init__.py"
        out[info.name] = ast.parse(path.read_text())
    return out


def test_every_command_is_run_by_a_fast_test(fast_files: list[Path]) -> None:
    from vault.cli import cli

    runs = [r for f in fast_files for r in string_runs(ast.parse(f.read_text()))]
    paths = command_paths(cli)
    assert len(paths) > 20
    missing = [
        " ".join(path)
        for path in paths
        if not any(tuple(r[i : i + len(path)]) == path for r in runs for i in range(len(r)))
    ]
    assert missing == [], f"no fast-tier test runs: {missing}"


def test_every_module_is_loaded_by_a_fast_test(fast_files: list[Path]) -> None:
    modules = vault_modules()
    reached: set[str] = set()
    for f in fast_files:
        tree = ast.parse(f.read_text())
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
