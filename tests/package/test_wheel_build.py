"""What `pip install` gives a user: one version, a typed package, the licence."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import requires, version
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_is_the_one_in_pyproject() -> None:
    assert version("memvault") == PYPROJECT["version"]
    result = run_cli("--version")
    assert result.code == 0
    assert result.out.strip() == f"memvault, version {PYPROJECT['version']}"


def test_version_is_written_nowhere_in_the_code() -> None:
    # A second copy of the string drifts from pyproject on the next release.
    quoted = f'"{PYPROJECT["version"]}"'
    holders = [p.name for p in (ROOT / "vault").glob("*.py") if quoted in p.read_text()]
    assert holders == []


def test_the_sdk_is_pinned_below_its_next_minor_version() -> None:
    # The session leans on SDK internals: a new minor must be a deliberate upgrade.
    (spec,) = [r for r in requires("memvault") or [] if r.startswith("openai-agents")]
    major, minor = (int(x) for x in version("openai-agents").split(".")[:2])
    assert f"<{major}.{minor + 1}" in spec


def pip(*args: str) -> None:
    # Offline: no dependency is fetched, and the build uses this environment's setuptools.
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True, timeout=600
    )


@pytest.mark.slow
def test_wheel_installs_a_working_typed_command_with_its_licence(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT))
    (wheel,) = wheels.glob("memvault-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "vault/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names

    # Installed on its own (the dependencies come from this environment), the wheel's
    # copy is the one that runs, and it reports the version from its own metadata.
    target = tmp_path / "site"
    pip("install", "--no-deps", "--target", str(target), str(wheel))
    assert (target / "vault" / "py.typed").is_file()
    probe = (
        "import vault, sys; print(vault.__file__); sys.argv=['memvault','--version']; "
        "from vault.cli import main; main()"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    where, said = out.stdout.splitlines()
    assert Path(where).is_relative_to(target)
    assert said == f"memvault, version {PYPROJECT['version']}"
