"""The benchmark is a package a reader can hold: one module per group, none over 500 lines.

These check its shape and its command line only; no benchmark runs and nothing is timed.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")
GROUPS = ("sessions", "chain", "cache", "cli", "rotation", "scale", "postgres", "transit")


def test_no_bench_module_is_over_500_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in BENCH.glob("*.py")}
    assert sizes, "no bench modules found"
    assert {name: n for name, n in sizes.items() if n > 500} == {}


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")


def test_each_group_lives_in_a_module_named_after_it() -> None:
    phases = importlib.import_module("bench.main").PHASES
    assert tuple(phases) == GROUPS
    assert {name: fn.__module__ for name, fn in phases.items()} == {
        name: f"bench.{name}" for name in GROUPS
    }


def test_bench_run_help_lists_every_flag_and_group() -> None:
    # As CI and bench/README.md run it: the script path, from the checkout.
    proc = subprocess.run(
        [sys.executable, "bench/run.py", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for flag in ("--quick", "--scale", "--json-out PATH", "--only"):
        assert flag in proc.stdout
    assert "{" + ",".join(GROUPS) + "}" in proc.stdout


def test_the_transit_group_without_a_server_is_skipped_saying_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    transit = importlib.import_module("bench.transit")
    monkeypatch.delenv(transit.ADDR_VAR, raising=False)
    monkeypatch.delenv(transit.TOKEN_VAR, raising=False)
    transit.bench_transit(None, None)
    assert "transit: skipped: no OpenBao server; run under scripts/with-openbao" in (
        capsys.readouterr().out
    )
