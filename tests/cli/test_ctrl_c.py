"""Ctrl-C: exit 130 and one line that tells the truth about what was committed.

A real SIGINT is sent to a real `memvault` process: during a rotation (paused at a
named step by the MEMVAULT_PAUSEPOINT test hook, so the signal lands where the test
means it to), and on a pseudo-terminal at the passphrase, confirmation and chat prompts.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    ROOT,
    add_items,
    assistant,
    authenticated_counts,
    default_sigint,
    key_entries,
    key_entry,
    rows,
    run_cli,
    run_on_terminal,
    user,
)

ITEMS = 2500  # more than one batch of the rotation (2,000 rows)


def fill(db: Path) -> None:
    add_items(db, "big", [user(f"message {i}") for i in range(ITEMS)])


def rotate_until_paused(step: str) -> subprocess.Popen[str]:
    """Start `memvault rotate` and return once it is paused at `step`."""
    env = dict(os.environ, MEMVAULT_PAUSEPOINT=step)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", "rotate"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=default_sigint,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120  # generous: the step is reached by progress, not time
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if ready:
            line = proc.stderr.readline()
            seen += line
            if f"paused at {step}" in line:
                return proc
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"rotate never reached {step}: {seen!r}")


def interrupt(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    try:
        _out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
        raise AssertionError(f"rotate ignored SIGINT: {err[-2000:]!r}") from None
    return proc.returncode, err


@pytest.mark.slow
def test_ctrl_c_before_the_switch_commits_nothing(vault: Any, vault_db: Path) -> None:
    fill(vault_db)
    before_kid = vault.sealer().kid
    before_rows = rows(vault_db)
    proc = rotate_until_paused("after-pending")  # the new key stored, the switch not committed
    code, err = interrupt(proc)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == (
        "memvault: error: interrupted; the rotation was not committed: the vault keeps its "
        "old key and nothing was changed"
    )
    assert "Traceback" not in err
    fresh = type(vault).open(vault_db)
    assert fresh.sealer(refresh=True).kid == before_kid
    assert rows(vault_db) == before_rows
    assert list(key_entries(fresh.vault_id)) == [key_entry(fresh)]  # the new key was dropped
    r = run_cli("show", "big", "--limit", "1")
    assert r.code == 0 and f"message {ITEMS - 1}" in r.out, r


@pytest.mark.slow
def test_ctrl_c_an_instant_after_the_switch_says_it_committed(vault: Any, vault_db: Path) -> None:
    """The switch committed, the interrupt came before the rotation could say so: the
    message follows what the file holds, never "nothing was changed"."""
    fill(vault_db)
    before_kid = vault.sealer().kid
    proc = rotate_until_paused("after-switch")
    code, err = interrupt(proc)
    assert code == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("memvault: error: interrupted after the rotation committed"), err
    assert "nothing was changed" not in err and "Traceback" not in err
    r = run_cli("--json", "status")  # the next command finishes it
    assert r.code == 0 and r.json()["kid"] != before_kid, r
    assert authenticated_counts(vault_db) == (ITEMS, 0, 0)


@pytest.mark.slow
def test_ctrl_c_amid_the_batches_says_the_next_command_finishes(vault: Any, vault_db: Path) -> None:
    fill(vault_db)
    before_kid = vault.sealer().kid
    proc = rotate_until_paused("after-batch")  # switched; the first batch of rows moved
    code, err = interrupt(proc)
    assert code == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("memvault: error: interrupted after the rotation committed"), err
    assert "next memvault command finishes" in last and "Traceback" not in err
    # Rows under both keys until then; the next command moves the rest and ends it.
    r = run_cli("--json", "status")
    assert r.code == 0, r
    st = r.json()
    assert st["kid"] != before_kid and st["items"] == ITEMS and not st["scrub_pending"]
    assert authenticated_counts(vault_db) == (ITEMS, 0, 0)
    assert {json.loads(data)["kid"] for data in rows(vault_db)} == {st["kid"]}
    assert list(key_entries(vault.vault_id)) == [f"{vault.vault_id}/{st['kid']}"]


@pytest.mark.slow
def test_ctrl_c_after_the_rotation_committed_says_so(vault: Any, vault_db: Path) -> None:
    fill(vault_db)
    before_kid = vault.sealer().kid
    proc = rotate_until_paused("after-commit")
    code, err = interrupt(proc)
    assert code == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("memvault: error: interrupted after the rotation committed"), err
    assert "next memvault command finishes" in last
    # The next command finishes the key swap and the scrub; every item reads.
    r = run_cli("--json", "status")
    assert r.code == 0, r
    st = r.json()
    assert st["kid"] != before_kid and st["items"] == ITEMS and not st["scrub_pending"]
    assert authenticated_counts(vault_db) == (ITEMS, 0, 0)
    assert run_cli("show", "big", "--limit", "1").code == 0


def test_ctrl_c_at_the_passphrase_prompt(vault: Any, tmp_path: Path) -> None:
    kit = tmp_path / "kit.json"
    code, out = run_on_terminal(
        ["key", "export", str(kit)], [(b"Recovery kit passphrase:", "\x03")]
    )
    assert code == 130, out
    assert b"memvault: error: interrupted at the passphrase prompt; nothing was changed" in out
    assert b"aborted" not in out and b"Traceback" not in out
    assert not kit.exists()


def test_ctrl_c_at_a_confirmation_is_not_a_refusal(vault: Any, vault_db: Path) -> None:
    code, out = run_on_terminal(["revoke"], [(b"[y/N]:", "\x03")])
    assert code == 130, out
    assert b"memvault: error: interrupted at the question; nothing was changed" in out
    assert vault.sealer(refresh=True)  # the key is still there
    # Answering "n" is a refusal: exit 1, and it says how to skip the question.
    code, out = run_on_terminal(["revoke"], [(b"[y/N]:", "n")])
    assert code == 1, out
    assert b"aborted; nothing was changed (pass --yes to skip the question)" in out
    assert vault.sealer(refresh=True)


def test_ctrl_c_at_the_chat_prompt(
    vault: Any, vault_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_items(vault_db, "carnet", [user("hello"), assistant("hi")])
    monkeypatch.setenv("MEMVAULT_CHAT_TEST_MODEL", "tests.cli.test_chat:scripted_model")
    code, out = run_on_terminal(["chat", "carnet"], [(b"you> ", "\x03")])
    assert code == 130, out
    assert b"memvault: error: interrupted" in out
    assert b"aborted" not in out and b"Traceback" not in out
    assert len(vault.items("carnet")[0]) == 2  # what was saved stays saved
