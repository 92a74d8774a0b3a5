"""A second name (hard link) at a side file is never written through.

A hard link at `history.db-wal`, `-shm` or `-journal` is a regular file, but its
contents belong to another name too: SQLite (which rewrites `-shm` on open) and a
shred (which zeroes side files) would destroy that other file.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
@pytest.mark.sweep
def test_shred_resumed_after_interruption_leaves_hard_linked_files_intact(
    cli: Any, vault_db: Path, suffix: str
) -> None:
    assert cli("init").code == 0
    cut = cli("shred", "--yes", env={"MEMVAULT_FAILPOINT": "shred-during-overwrite"})
    assert cut.code != 0 and vault_db.exists(), cut
    victim = vault_db.parent.parent / "precious.txt"
    victim.write_bytes(b"someone else's data\n")
    os.link(victim, vault_db.with_name(vault_db.name + suffix))

    r = cli("shred", "--yes")

    assert r.code == 0, r
    assert victim.read_bytes() == b"someone else's data\n"
    assert not vault_db.exists()
    assert not vault_db.with_name(vault_db.name + suffix).exists()


def test_status_refuses_a_hard_link_at_shm_without_touching_it(cli: Any, vault_db: Path) -> None:
    assert cli("init").code == 0
    victim = vault_db.parent.parent / "precious.txt"
    victim.write_bytes(b"someone else's data\n")
    os.link(victim, vault_db.with_name(vault_db.name + "-shm"))

    r = cli("status")

    assert r.code == 1, r
    assert "hard link" in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert victim.read_bytes() == b"someone else's data\n"
    assert cli("shred", "--yes").code == 0
    assert victim.read_bytes() == b"someone else's data\n"


def test_key_import_of_a_fifo_is_refused_at_once(cli: Any, tmp_path: Path) -> None:
    assert cli("init").code == 0
    fifo = tmp_path / "kit.json"
    os.mkfifo(fifo)

    r = cli(
        "key",
        "import",
        "--passphrase-stdin",
        str(fifo),
        input="correct horse battery staple\n",
        timeout=60,
    )

    assert r.code == 2, r
    assert "FIFO" in r.err and len(r.err.strip().splitlines()) == 1


def test_key_export_force_never_replaces_a_fifo_or_device(cli: Any, tmp_path: Path) -> None:
    # A FIFO stands in for /dev/null: as root, --force used to rename the kit over it.
    assert cli("init").code == 0
    fifo = tmp_path / "kit.json"
    os.mkfifo(fifo)

    r = cli(
        "key",
        "export",
        "--force",
        "--passphrase-stdin",
        str(fifo),
        input="correct horse battery staple\n",
    )

    assert r.code == 2, r
    assert "FIFO" in r.err and len(r.err.strip().splitlines()) == 1
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_ctrl_c_exits_130_and_says_interrupted(vault: Any, vault_db: Path) -> None:
    # Click turns Ctrl-C into Abort: it must not pass for a refused confirmation
    # ("nothing was changed" would be false once a shred has destroyed the key).
    proc = subprocess.Popen(
        [sys.executable, "-m", "vault", "shred"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    seen = b""
    while b"[y/N]" not in seen:  # the question is asked: the process waits on stdin
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, seen
        seen += chunk
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)

    assert proc.returncode == 130, (proc.returncode, err)
    assert b"interrupted" in err and b"--yes" not in err and b"Traceback" not in err
    assert vault_db.exists()
