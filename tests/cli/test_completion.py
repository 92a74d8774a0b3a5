"""Shell completion: `memvault completion SHELL`, and Click's completion protocol run
for real in a subprocess (the way the installed script calls memvault at each TAB)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, add_items, run_cli, user

# A keyring backend that leaves a mark and fails the moment anything loads it.
LOUD_BACKEND = """
import os
from pathlib import Path
from keyring.backend import KeyringBackend

class Loud(KeyringBackend):
    priority = 1

    def __init__(self):
        Path(os.environ["LOUD_MARK"]).write_text("the keyring was loaded")
        raise RuntimeError("completion touched the keyring")

    def get_password(self, service, username):
        raise RuntimeError("completion touched the keyring")

    def set_password(self, service, username, password):
        raise RuntimeError("completion touched the keyring")

    def delete_password(self, service, username):
        raise RuntimeError("completion touched the keyring")
"""


def complete(line: str, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """What the bash script gets for `line` (completing its last word), as (type, value)."""
    words = line.split(" ")
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.update(
        COMP_WORDS=line, COMP_CWORD=str(len(words) - 1), _MEMVAULT_COMPLETE="bash_complete"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "vault"],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc
    assert proc.stderr == "", proc
    return [tuple(x.split(",", 1)) for x in proc.stdout.splitlines() if x]  # type: ignore[misc]


def values(line: str, env: dict[str, str] | None = None) -> list[str]:
    return [v for _t, v in complete(line, env)]


def loud_keyring(tmp_path: Path) -> dict[str, str]:
    folder = tmp_path / "loudkeyring"
    folder.mkdir()
    (folder / "loud_backend.py").write_text(LOUD_BACKEND)
    return {
        "PYTHONPATH": str(folder),
        "PYTHON_KEYRING_BACKEND": "loud_backend.Loud",
        "LOUD_MARK": str(tmp_path / "keyring-was-loaded"),
        "DBUS_SESSION_BUS_ADDRESS": "unix:path=/nonexistent",
    }


# --------------------------------------------------------------------------
def test_session_ids_complete_from_a_real_vault(vault: Any, vault_db: Path) -> None:
    for sid in ("carnet-local", "carnet-travail", "autre"):
        add_items(vault_db, sid, [user("hello " + sid)])
    assert sorted(values("memvault show car")) == ["carnet-local", "carnet-travail"]
    assert sorted(values("memvault clear ")) == ["autre", "carnet-local", "carnet-travail"]
    assert values("memvault pop aut") == ["autre"]
    assert complete("memvault show carnet-l") == [("plain", "carnet-local")]
    assert values("memvault show zz") == []


def test_ids_holding_control_characters_are_not_offered(vault: Any, vault_db: Path) -> None:
    for sid in ("s-plain", "s-esc\x1b[2J", "s-tab\tx", "s-c1\x9bx", "s-nl\nx", "s-del\x7f"):
        add_items(vault_db, sid, [user("hello")])
    assert values("memvault show s-") == ["s-plain"]


def test_session_ids_come_from_the_vault_named_on_the_line(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    add_items(vault_db, "carnet-local", [user("hello")])
    elsewhere = {"MEMVAULT_DB": str(tmp_path / "nothing-here.db")}
    assert values("memvault show ", elsewhere) == []
    assert values(f"memvault --db {vault_db} show ", elsewhere) == ["carnet-local"]
    assert values(f"memvault show --db {vault_db} ", elsewhere) == ["carnet-local"]


def test_completion_never_loads_the_keyring(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "carnet-local", [user("hello")])
    loud = loud_keyring(tmp_path)
    mark = Path(loud["LOUD_MARK"])
    assert values("memvault show carnet", loud) == ["carnet-local"]
    assert not mark.exists()
    # Control: a command that needs the key does load this backend, and fails.
    r = run_cli("show", "carnet-local", env=loud)
    assert r.code != 0 and mark.exists(), r


def test_a_missing_vault_completes_nothing_and_creates_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "absent"
    env = {"MEMVAULT_DB": str(folder / "history.db")}
    assert complete("memvault show ", env) == []
    assert complete(f"memvault --db {tmp_path / 'x.db'} clear ", env) == []
    assert not folder.exists() and not (tmp_path / "x.db").exists()


def test_completion_creates_no_side_file_beside_a_closed_vault(vault: Any, vault_db: Path) -> None:
    add_items(vault_db, "carnet-local", [user("hello")])
    # Closed cleanly: no -wal, no -shm (a read-only reader would create both).
    assert run_cli("status").code == 0
    before = sorted(p.name for p in vault_db.parent.iterdir())
    assert before == ["history.db"], before
    assert values("memvault show ") == ["carnet-local"]
    assert sorted(p.name for p in vault_db.parent.iterdir()) == before


def test_a_file_that_is_not_a_vault_completes_nothing(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    assert complete(f"memvault --db {junk} show ") == []
    assert junk.read_bytes() == b"not a database at all" * 100


@pytest.mark.parametrize(
    "line",
    [
        "memvault --db ",
        "memvault key export ",
        "memvault key import ",
        "memvault key export --passphrase-file ",
        "memvault import ",
        "memvault shred --receipt ",
    ],
)
def test_paths_complete_as_files(line: str) -> None:
    assert complete(line) == [("file", "")]


def test_commands_and_options_complete() -> None:
    assert "completion" in values("memvault comp")
    assert {"export", "import"} <= set(values("memvault key "))
    assert "--passphrase-stdin" in values("memvault key import --pass")
    assert values("memvault completion ") == ["bash", "zsh", "fish"]


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_clicks_own_script(shell: str) -> None:
    r = run_cli("completion", shell)
    assert r.code == 0, r
    clicks = subprocess.run(
        [sys.executable, "-m", "vault"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, _MEMVAULT_COMPLETE=f"{shell}_source"),
        timeout=60,
    )
    assert clicks.returncode == 0
    assert r.out == clicks.stdout
    assert "_MEMVAULT_COMPLETE" in r.out and "memvault" in r.out


def test_the_bash_script_completes_session_ids_in_bash(vault: Any, vault_db: Path) -> None:
    # The whole chain: the script's function, run by bash, calling memvault.
    add_items(vault_db, "carnet-local", [user("hello")])
    # The console script sits next to this Python (scripts/test also puts it on PATH; a
    # plain `.venv/bin/python -m pytest` does not).
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    assert shutil.which("memvault", path=path), "the package's console script is installed"
    script = (
        "source <(memvault completion bash); COMP_WORDS=(memvault show carn); COMP_CWORD=2; "
        '_memvault_completion memvault; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    env = {**os.environ, "PATH": path}
    proc = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc
    assert proc.stdout.split() == ["carnet-local"], proc


def test_completion_refusals() -> None:
    for args, needle in [
        (["completion", "tcsh"], "'tcsh' is not one of"),
        (["completion"], "Missing argument"),
        (["--json", "completion", "bash"], "--json does not apply to `completion`"),
        (["completion", "bash", "--db", "x.db"], "--db does not apply to `completion`"),
    ]:
        r = run_cli(*args)
        assert r.code == 2, (args, r)
        last = r.err.splitlines()[-1]
        assert last.startswith("memvault: error: ") and needle in last, (args, r)
        assert "Traceback" not in r.err
