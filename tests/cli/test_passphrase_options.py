"""Recovery-kit passphrases for scripts: --passphrase-file and --passphrase-stdin.

Real subprocesses, the real keyring, real pipes (a named FIFO and bash's
process substitution).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, key_entry, run_cli, run_on_terminal, user

PASS = "correct horse battery staple"


def one_line_error(r: Any, code: int, *needles: str) -> str:
    assert r.code == code, r
    assert r.err.count("\n") == 1, r
    assert r.err.startswith("memvault: error: ") and "Traceback" not in r.err, r
    for needle in needles:
        assert needle in r.err, r
    return str(r.err)


def secret_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_bytes(text.encode())
    path.chmod(mode)
    return path


def holds_open(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (Linux /proc)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def lose_key(vault: Any) -> str:
    key = vault.keystore.get(key_entry(vault))
    assert key and vault.keystore.delete(key_entry(vault))
    return str(key)


def restored(vault: Any, key: str) -> bool:
    return bool(vault.keystore.get(key_entry(vault)) == key)


# --------------------------------------------------------------------------
# The two options, round trip through a lost keyring entry
# --------------------------------------------------------------------------
def test_passphrase_file_round_trip(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "s1", [user("the code name is NORD-42")])
    pw = secret_file(tmp_path / "pass.txt", PASS + "\n")
    kit = tmp_path / "kit.json"
    r = run_cli("key", "export", "--passphrase-file", str(pw), str(kit))
    assert r.code == 0, r
    assert r.err == "" and PASS not in r.out
    key = lose_key(vault)

    r = run_cli("key", "import", "--passphrase-file", str(pw), str(kit))
    assert r.code == 0, r
    assert "restored key" in r.out and r.err == "" and PASS not in r.out
    assert restored(vault, key)
    assert "NORD-42" in run_cli("show", "s1").out


def test_passphrase_stdin_round_trip_strips_one_newline(vault: Any, tmp_path: Path) -> None:
    kit = tmp_path / "kit.json"
    # printf %s "$PASS": no newline at all.
    r = run_cli("key", "export", "--passphrase-stdin", str(kit), input=PASS)
    assert r.code == 0, r
    assert PASS not in r.out + r.err
    key = lose_key(vault)
    # echo "$PASS": one newline, removed; the same passphrase.
    r = run_cli("key", "import", "--passphrase-stdin", str(kit), input=PASS + "\n")
    assert r.code == 0, r
    assert restored(vault, key)


def test_passphrase_file_can_be_a_process_substitution(vault: Any, tmp_path: Path) -> None:
    # <(...) hands over /dev/fd/63: a pipe, accepted, read to its end.
    kit = tmp_path / "kit.json"
    env = dict(os.environ, PY=sys.executable, PW=PASS, KIT=str(kit))

    def bash(script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    proc = bash('"$PY" -m vault key export --passphrase-file <(printf "%s\\n" "$PW") "$KIT"')
    assert proc.returncode == 0, proc
    key = lose_key(vault)
    # The writer takes a moment: memvault waits for it.
    proc = bash('"$PY" -m vault key import --passphrase-file <(sleep 1; printf %s "$PW") "$KIT"')
    assert proc.returncode == 0, proc
    assert "restored key" in proc.stdout and PASS not in proc.stdout + proc.stderr
    assert "readable by other users" not in proc.stderr  # a pipe is not a shared file
    assert restored(vault, key)


def test_a_named_fifo_whose_writer_starts_late_is_read(vault: Any, tmp_path: Path) -> None:
    fifo = tmp_path / "pass.fifo"
    os.mkfifo(fifo, 0o600)
    kit = tmp_path / "kit.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", "key", "export", "--passphrase-file", str(fifo), str(kit)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writer = None
    try:
        # The writer starts only once memvault holds the FIFO open (seen in /proc):
        # memvault must wait for it rather than take "no writer yet" for the end.
        deadline = time.monotonic() + 120
        while not holds_open(proc.pid, fifo):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "memvault never opened the FIFO"
            time.sleep(0.05)
        # A process, not a thread, so that a failure can always kill it.
        writer = subprocess.Popen(
            ["sh", "-c", 'printf "%s\\n" "$PW" > "$FIFO"'],
            env=dict(os.environ, PW=PASS, FIFO=str(fifo)),
        )
        out, err = proc.communicate(timeout=120)
    finally:
        for p in (proc, writer):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait()
    assert proc.returncode == 0, (out, err)
    assert kit.exists()
    assert run_cli("key", "import", "--passphrase-stdin", str(kit), input=PASS).code == 0


@pytest.mark.slow
def test_a_fifo_nobody_writes_to_is_refused_not_waited_on_for_ever(
    vault: Any, tmp_path: Path
) -> None:
    fifo = tmp_path / "pass.fifo"
    os.mkfifo(fifo, 0o600)
    kit = tmp_path / "kit.json"
    r = run_cli("key", "export", "--passphrase-file", str(fifo), str(kit), timeout=90)
    one_line_error(r, 2, "nothing came through the pipe")
    assert not kit.exists()


# --------------------------------------------------------------------------
# Usage errors
# --------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["export", "import"])
def test_no_terminal_and_no_option_names_both_options(
    vault: Any, tmp_path: Path, command: str
) -> None:
    kit = tmp_path / "kit.json"
    if command == "import":
        assert run_cli("key", "export", "--passphrase-stdin", str(kit), input=PASS).code == 0
    before = kit.read_bytes() if kit.exists() else None
    key = lose_key(vault) if command == "import" else None
    # A passphrase on stdin is no longer read unasked.
    r = run_cli("key", command, str(kit), input=PASS + "\n")
    one_line_error(r, 2, "no terminal", "--passphrase-file", "--passphrase-stdin")
    assert PASS not in r.out + r.err
    assert (kit.read_bytes() if kit.exists() else None) == before
    if key is not None:
        assert vault.keystore.get(key_entry(vault)) is None


def test_both_options_are_a_usage_error(vault: Any, tmp_path: Path) -> None:
    pw = secret_file(tmp_path / "pass.txt", PASS)
    kit = tmp_path / "kit.json"
    r = run_cli(
        "key", "export", "--passphrase-file", str(pw), "--passphrase-stdin", str(kit), input=PASS
    )
    one_line_error(r, 2, "exclude each other")
    assert not kit.exists()


def test_the_json_failure_document_for_a_missing_option(vault: Any, tmp_path: Path) -> None:
    r = run_cli("--json", "key", "export", str(tmp_path / "kit.json"))
    assert r.code == 2
    assert r.json()["exit_code"] == 2 and "--passphrase-stdin" in r.json()["error"]


def test_passphrase_stdin_refuses_a_terminal(vault: Any, tmp_path: Path) -> None:
    kit = tmp_path / "kit.json"
    code, out = run_on_terminal(["key", "export", "--passphrase-stdin", str(kit)], [])
    assert code == 2, out
    assert b"needs the passphrase piped in" in out and b"Traceback" not in out
    assert not kit.exists()


# --------------------------------------------------------------------------
# What a passphrase file may hold
# --------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("", "passphrase is empty"),
        ("\n", "passphrase is empty"),
        ("\r\n", "passphrase is empty"),
        (PASS + "\n\n", "more than one line"),
        ("first line\nsecond line\n", "more than one line"),
        ("x" * 5000, "more than 4096 bytes"),
    ],
)
def test_passphrase_file_contents_refused(
    vault: Any, tmp_path: Path, content: str, needle: str
) -> None:
    pw = secret_file(tmp_path / "pass.txt", content)
    kit = tmp_path / "kit.json"
    r = run_cli("key", "export", "--passphrase-file", str(pw), str(kit))
    one_line_error(r, 2, needle)
    assert not kit.exists()


@pytest.mark.slow
def test_only_one_trailing_newline_is_removed_and_spaces_are_kept(
    vault: Any, tmp_path: Path
) -> None:
    kit = tmp_path / "kit.json"
    pw = secret_file(tmp_path / "pass.txt", " " + PASS + " \r\n")  # CRLF counts as one newline
    assert run_cli("key", "export", "--passphrase-file", str(pw), str(kit)).code == 0
    lose_key(vault)
    r = run_cli("key", "import", "--passphrase-stdin", str(kit), input=PASS)
    one_line_error(r, 1, "did not open")
    r = run_cli("key", "import", "--passphrase-stdin", str(kit), input=" " + PASS + " \n")
    assert r.code == 0, r


def test_passphrase_file_that_is_missing_a_folder_or_a_device(vault: Any, tmp_path: Path) -> None:
    kit = tmp_path / "kit.json"
    for path, needle in [
        (tmp_path / "absent.txt", "does not exist"),
        (tmp_path, "is a folder"),
        (Path("/dev/null"), "is a device"),
    ]:
        r = run_cli("key", "export", "--passphrase-file", str(path), str(kit))
        one_line_error(r, 2, needle)
    assert not kit.exists()


def test_passphrase_file_readable_by_others_warns_in_one_line(vault: Any, tmp_path: Path) -> None:
    pw = secret_file(tmp_path / "pass.txt", PASS + "\n", mode=0o644)
    kit = tmp_path / "kit.json"
    r = run_cli("key", "export", "--passphrase-file", str(pw), str(kit))
    assert r.code == 0, r
    lines = r.err.splitlines()
    assert len(lines) == 1, r
    assert lines[0].startswith("warning: ") and "readable by other users" in lines[0]
    assert "0644" in lines[0] and PASS not in r.err
    assert stat.S_IMODE(pw.stat().st_mode) == 0o644  # told, not changed


def test_short_passphrase_rules_still_apply(vault: Any, tmp_path: Path) -> None:
    pw = secret_file(tmp_path / "pass.txt", "short\n")
    kit = tmp_path / "kit.json"
    r = run_cli("key", "export", "--passphrase-file", str(pw), str(kit))
    assert r.code == 0, r
    assert "shorter than 12 characters" in r.err and "short\n" not in r.out


@pytest.mark.slow
def test_import_with_stdin_passphrase_needs_yes_for_the_question(
    vault: Any, tmp_path: Path
) -> None:
    from vault import crypto

    kit = tmp_path / "kit.json"
    assert run_cli("key", "export", "--passphrase-stdin", str(kit), input=PASS).code == 0
    key = str(vault.keystore.get(key_entry(vault)))
    vault.keystore.set(key_entry(vault), crypto.generate_key())  # a damaged entry
    # stdin holds the passphrase and nothing else: an answer after it is a second line.
    r = run_cli("key", "import", "--passphrase-stdin", str(kit), input=PASS + "\ny\n")
    one_line_error(r, 2, "more than one line")
    r = run_cli("key", "import", "--passphrase-stdin", str(kit), input=PASS)
    assert r.code == 1, r  # the question finds stdin at its end: no answer, no change
    assert r.err.splitlines()[-1].startswith("memvault: error: aborted"), r
    assert "--yes" in r.err and "Traceback" not in r.err
    assert not restored(vault, key)
    pw = secret_file(tmp_path / "pass.txt", PASS)
    r = run_cli("key", "import", "--passphrase-file", str(pw), str(kit), input="y\n")
    assert r.code == 0, r  # with a file, stdin answers the question
    assert restored(vault, key)


def test_help_names_the_options_with_examples() -> None:
    for command in ("export", "import"):
        r = run_cli("key", command, "--help")
        assert r.code == 0, r
        assert "--passphrase-file FILE" in r.out and "--passphrase-stdin" in r.out
    assert 'printf %s "$PASS" | memvault key import --passphrase-stdin kit.json' in r.out
