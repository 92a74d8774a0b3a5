"""The guide's four checks, each step in its own process (ScriptedModel, offline)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import GUIDE_CODE as CODE
from tests.conftest import ROOT, keyring_entries, raw_bytes, run_cli
from tests.conftest import guide_step as step


@pytest.mark.slow
def test_four_checks(vault: Any, vault_db: Path) -> None:
    # 1. A turn stores the code name; the process exits; the file stays.
    out = step("write", vault_db)
    assert out["items_after"] == 2
    assert vault_db.exists()
    items, _, _ = type(vault).open(vault_db).items("carnet-local")
    assert any(CODE in json.dumps(i) for i in items if i.get("role") == "user")
    data = raw_bytes(vault_db)
    assert data, "no bytes read"
    assert CODE.encode() not in data
    assert b"Remember this code name" not in data

    # 2. A second process finds the items, and the model is given the code name.
    out = step("ask", vault_db)
    assert out["items_before"] > 0
    assert CODE in out["model_input"]
    assert CODE in out["answer"]

    # 3. `memvault clear` empties the session; the other session is untouched.
    r = run_cli("clear", "carnet-local", "--yes")
    assert r.code == 0, r
    out = step("ask", vault_db)
    assert out["items_before"] == 0
    assert CODE not in out["model_input"]
    assert CODE not in out["answer"]
    others, _, _ = type(vault).open(vault_db).items("autre-session")
    assert others == [{"role": "user", "content": "a turn of another session"}]

    # 4. Negative control: the same id on an in-memory SQLiteSession finds nothing.
    assert step("memory", vault_db)["items_before"] == 0


def test_offline_model_answers_only_from_history() -> None:
    from vault.demo import offline_answer

    assert CODE in offline_answer(
        [
            {"role": "user", "content": f"remember {CODE}"},
            {"role": "user", "content": "which code?"},
        ]
    )
    assert CODE not in offline_answer([{"role": "user", "content": "which code?"}])


@pytest.mark.slow
def test_demo_command_passes_and_cleans_up(tmp_path: Path) -> None:

    r = run_cli("demo", timeout=600, env={"TMPDIR": str(tmp_path)})
    assert r.code == 0, r
    assert "offline stand-in" in r.out
    assert r.out.count("PASS") >= 9 and "FAIL" not in r.out
    assert "all checks passed" in r.out
    # The throwaway vault folder and its keyring entry are gone.
    assert not list(tmp_path.glob("memvault-demo-*"))
    ids = re.findall(r"throwaway vault .*, id (mv-[0-9a-f]+)", r.out)
    assert len(ids) == 1, r.out
    assert keyring_entries(ids[0]) == {}


@pytest.mark.slow
def test_readme_main_job_runs_where_keyring_would_pick_a_plaintext_file(tmp_path: Path) -> None:
    # No session bus: `keyring` itself would fall back to keyrings.alt's plaintext file,
    # which memvault refuses. scripts/demo must notice and use a private Secret Service.
    import os

    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "DBUS_SESSION_BUS_ADDRESS",
            "PYTHON_KEYRING_BACKEND",
            "MEMVAULT_IN_PRIVATE_KEYRING",
            "GNOME_KEYRING_CONTROL",
        )
    }
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / ".local" / "share"), TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [str(ROOT / "scripts" / "demo")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all checks passed" in proc.stdout
    assert "private throwaway Secret Service" in proc.stderr
    assert not list(home.rglob("keyring_pass.cfg"))  # no master key in a plain file
