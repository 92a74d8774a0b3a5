"""The recovery kit (`memvault key export` / `key import`), against the real keyring."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    add_items,
    assistant,
    key_entry,
    keyring_entries,
    run_cli,
    run_on_terminal,
    user,
)

PASS = "correct horse battery staple"
HISTORY = [user("the code name is NORD-42"), assistant("Noted: NORD-42.")]


def keyring_key(vault: Any) -> str:
    key = vault.keystore.get(key_entry(vault))
    assert key
    return str(key)


def no_secret(key: str, *results: Any) -> None:
    """The key appears in no output, in no encoding we might have used."""
    raw = base64.urlsafe_b64decode(key)
    forms = [key, key.rstrip("="), raw.hex(), base64.b64encode(raw).decode()]
    for r in results:
        for text in (r.out, r.err):
            for form in forms:
                assert form not in text, "the key was printed"


def one_line_error(r: Any) -> str:
    assert r.err.count("\n") == 1, r
    assert r.err.startswith("memvault: error: ") and "Traceback" not in r.err, r
    return str(r.err)


def export(kit: Path, *args: str, passphrase: str = PASS) -> Any:
    return run_cli(*args, "key", "export", "--passphrase-stdin", str(kit), input=passphrase + "\n")


def import_(kit: Path, *args: str, passphrase: str = PASS, extra: str = "") -> Any:
    if not extra:
        return run_cli(
            *args, "key", "import", "--passphrase-stdin", str(kit), input=passphrase + "\n"
        )
    # Answers to questions on stdin: the passphrase comes from a file instead.
    pw = kit.with_name(kit.name + ".pass")
    pw.write_text(passphrase + "\n")
    pw.chmod(0o600)
    return run_cli(*args, "key", "import", "--passphrase-file", str(pw), str(kit), input=extra)


def copy_vault(src: Path, dest: Path) -> None:
    dest.parent.mkdir(mode=0o700)
    for suffix in ("", "-wal", "-shm"):
        p = src.with_name(src.name + suffix)
        if p.exists():
            shutil.copy2(p, dest.with_name(dest.name + suffix))


# --------------------------------------------------------------------------
@pytest.mark.slow
def test_new_laptop_round_trip(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "carnet-local", HISTORY)
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"

    old_umask = os.umask(0)  # the child inherits a wide-open umask: 0600 must still hold
    try:
        r_export = export(kit)
    finally:
        os.umask(old_umask)
    assert r_export.code == 0, r_export
    assert stat.S_IMODE(kit.stat().st_mode) == 0o600
    doc = json.loads(kit.read_text())
    assert doc["version"] == 2 and doc["vault_id"] == vault.vault_id
    assert doc["kid"] == vault.meta()["kid"] and doc["kids"] == [doc["kid"]]
    assert doc["kdf"]["name"] == "scrypt" and doc["kdf"]["n"] >= 2**14
    assert {"salt", "n", "r", "p"} <= set(doc["kdf"]) and doc["nonce"] and doc["ciphertext"]
    assert key not in kit.read_text()
    assert base64.urlsafe_b64decode(key) not in kit.read_bytes()

    # The new laptop: a copy of the vault file, and a keyring without the key.
    laptop = tmp_path / "laptop" / "history.db"
    copy_vault(vault_db, laptop)
    assert vault.keystore.delete(key_entry(vault))
    r_show = run_cli("--db", str(laptop), "show", "carnet-local")
    assert r_show.code == 4, r_show
    assert "key import" in one_line_error(r_show)

    r_import = import_(kit, "--db", str(laptop))
    assert r_import.code == 0, r_import
    assert "restored key" in r_import.out
    assert vault.keystore.get(key_entry(vault)) == key

    r_show = run_cli("--db", str(laptop), "--json", "show", "carnet-local")
    assert r_show.code == 0, r_show
    assert r_show.json()["items"] == HISTORY
    no_secret(key, r_export, r_import, r_show)

    events = {e["event"]: e for e in type(vault).open(laptop).audit_log()}
    assert events["key-export"]["kid"] == doc["kid"]
    assert events["key-import"]["keyring_before"] == "missing"
    log = run_cli("--db", str(laptop), "log")
    assert log.code == 0 and "key-import" in log.out
    no_secret(key, log)


def test_wrong_passphrase(vault: Any, tmp_path: Path) -> None:
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    assert vault.keystore.delete(key_entry(vault))
    r = import_(kit, passphrase="not the passphrase")
    assert r.code == 1, r
    assert "wrong passphrase" in one_line_error(r)
    assert vault.keystore.get(key_entry(vault)) is None  # nothing was stored
    no_secret(key, r)
    assert import_(kit).code == 0
    assert vault.keystore.get(key_entry(vault)) == key


@pytest.mark.slow
def test_tampered_kit(vault: Any, tmp_path: Path) -> None:
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    assert vault.keystore.delete(key_entry(vault))
    doc = json.loads(kit.read_text())

    def variant(name: str, change: Any) -> Path:
        d = json.loads(json.dumps(doc))
        change(d)
        p = tmp_path / name
        p.write_text(json.dumps(d))
        return p

    def flip(b64: str) -> str:
        raw = bytearray(base64.b64decode(b64))
        raw[len(raw) // 2] ^= 0x01
        return base64.b64encode(bytes(raw)).decode()

    authenticated = [
        variant("ciphertext.json", lambda d: d.update(ciphertext=flip(d["ciphertext"]))),
        variant("nonce.json", lambda d: d.update(nonce=flip(d["nonce"]))),
        variant("salt.json", lambda d: d["kdf"].update(salt=flip(d["kdf"]["salt"]))),
        variant("created.json", lambda d: d.update(created_at="2000-01-01T00:00:00Z")),
    ]
    for p in authenticated:
        r = import_(p)
        assert r.code == 1, (p.name, r)
        assert "did not open: wrong passphrase, or the kit was altered" in one_line_error(r)
        no_secret(key, r)

    malformed = [
        variant("params.json", lambda d: d["kdf"].update(n=2**40)),
        variant("version.json", lambda d: d.update(version=99)),
        variant("nonce-len.json", lambda d: d.update(nonce=base64.b64encode(b"x").decode())),
    ]
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{ not json")
    for p in [*malformed, garbage]:
        r = import_(p)
        assert r.code == 1, (p.name, r)
        assert "not a usable memvault recovery kit" in one_line_error(r)
    assert vault.keystore.get(key_entry(vault)) is None
    assert import_(kit).code == 0  # the untouched kit still works


def test_hostile_kits_are_refused_in_one_line(vault: Any, tmp_path: Path) -> None:
    """A version or scrypt parameter that only equals a valid one (true, 1.0), scrypt r=1
    with our n (past RFC 7914's n < 2**(16 r): OpenSSL raised MemoryError), and JSON nested
    deeper than the parser goes (RecursionError): each a kit memvault never writes."""
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    doc = json.loads(kit.read_text())

    def variant(name: str, **changes: Any) -> Path:
        d = json.loads(json.dumps(doc))
        kdf = {k[4:]: changes.pop(k) for k in list(changes) if k.startswith("kdf_")}
        d.update(changes)
        d["kdf"].update(kdf)
        p = tmp_path / name
        p.write_text(json.dumps(d))
        return p

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps(doc)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
    hostile = [
        variant("version-true.json", version=True),
        variant("version-float.json", version=1.0),
        variant("r1.json", kdf_r=1),
        variant("r-true.json", kdf_r=True),
        variant("p-true.json", kdf_p=True),
        variant("n-float.json", kdf_n=float(doc["kdf"]["n"])),
        deep,
        nested,
    ]
    results = {p.name: import_(p) for p in hostile}
    refused = "memvault: error: " + str(tmp_path)
    wrong = {
        name: r.err
        for name, r in results.items()
        if r.code != 1
        or not r.err.startswith(refused)
        or "is not a usable memvault recovery kit" not in r.err
        or r.err.count("\n") != 1
    }
    assert wrong == {}
    for r in results.values():
        no_secret(key, r)
    assert keyring_key(vault) == key


def test_kit_from_another_vault(vault: Any, tmp_path: Path) -> None:
    from vault import Vault
    from vault.engines.sqlite.vault import shred

    other_db = tmp_path / "other" / "history.db"
    other = Vault.init(other_db)
    try:
        kit = tmp_path / "other-kit.json"
        assert export(kit, "--db", str(other_db)).code == 0
        assert vault.keystore.delete(key_entry(vault))
        r = import_(kit)
        assert r.code == 4, r
        err = one_line_error(r)
        assert other.vault_id in err and vault.vault_id in err
        assert vault.keystore.get(key_entry(vault)) is None
        no_secret(keyring_key(other), r)
    finally:
        shred(other_db)


@pytest.mark.slow
def test_kit_from_before_a_rotation(vault: Any, vault_db: Path, tmp_path: Path) -> None:
    add_items(vault_db, "carnet-local", HISTORY)
    old_kid = vault.meta()["kid"]
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    r = run_cli("rotate")
    assert r.code == 0, r
    assert "older recovery kits no longer match" in r.out
    new_kid = vault.meta()["kid"]
    assert new_kid != old_kid
    new_key = keyring_key(vault)

    r = import_(kit)
    assert r.code == 4, r
    err = one_line_error(r)
    assert old_kid in err and new_kid in err and "rotation" in err
    assert vault.keystore.get(key_entry(vault)) == new_key

    # Claiming the new key id in the header does not help: it is authenticated data.
    doc = json.loads(kit.read_text())
    doc["kid"], doc["kids"] = new_kid, [new_kid]
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(doc))
    r = import_(forged)
    assert r.code == 1, r
    assert "altered" in one_line_error(r)
    assert vault.keystore.get(key_entry(vault)) == new_key

    # A kit exported after the rotation works.
    fresh = tmp_path / "fresh.json"
    assert export(fresh).code == 0
    assert vault.keystore.delete(key_entry(vault))
    assert import_(fresh).code == 0
    assert run_cli("--json", "show", "carnet-local").json()["items"] == HISTORY


def test_revoked_vault_refuses_a_kit(vault: Any, tmp_path: Path) -> None:
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    assert run_cli("revoke", "--yes").code == 0
    r = import_(kit)
    assert r.code == 4, r
    assert "revoked" in one_line_error(r)
    assert keyring_entries(vault.vault_id) == {}


def test_import_leaves_a_working_key_alone(vault: Any, tmp_path: Path) -> None:
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    r = import_(kit)
    assert r.code == 0, r
    assert "already holds" in r.out and "nothing was changed" in r.out
    assert vault.keystore.get(key_entry(vault)) == key
    no_secret(key, r)


@pytest.mark.slow
def test_import_replaces_a_damaged_entry_of_its_key(
    vault: Any, vault_db: Path, tmp_path: Path
) -> None:
    from vault import crypto

    add_items(vault_db, "carnet-local", HISTORY)
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    stranger = crypto.generate_key()
    vault.keystore.set(key_entry(vault), stranger)
    assert run_cli("show", "carnet-local").code == 4

    # Asked first; no answer means no change.
    r = import_(kit)
    assert r.code == 1, r
    assert "aborted" in r.err
    assert vault.keystore.get(key_entry(vault)) == stranger

    r = run_cli("key", "import", str(kit), "--yes", "--passphrase-stdin", input=PASS + "\n")
    assert r.code == 0, r
    assert "replaced key " + crypto.key_id(stranger) in r.out
    assert vault.keystore.get(key_entry(vault)) == key
    assert run_cli("--json", "show", "carnet-local").json()["items"] == HISTORY
    no_secret(key, r)
    event = [e for e in vault.audit_log() if e["event"] == "key-import"][-1]
    assert event["keyring_before"] == "mismatched"
    assert event["replaced_kid"] == crypto.key_id(stranger)


@pytest.mark.slow
def test_export_refusals(vault: Any, tmp_path: Path) -> None:
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    kit.write_text("precious\n")
    r = export(kit)
    assert r.code == 2 and "already exists" in one_line_error(r)
    assert kit.read_text() == "precious\n"
    r = run_cli("key", "export", str(kit), "--force", "--passphrase-stdin", input=PASS + "\n")
    assert r.code == 2 and "not a recovery kit" in one_line_error(r)
    assert kit.read_text() == "precious\n"
    kit.unlink()
    assert export(kit).code == 0

    r = export(tmp_path / "empty.json", passphrase="")
    assert r.code == 2 and "passphrase is empty" in one_line_error(r)
    assert not (tmp_path / "empty.json").exists()

    r = export(tmp_path / "short.json", passphrase="short")
    assert r.code == 0 and "shorter than" in r.err

    kit.chmod(0o644)
    r = run_cli("key", "export", str(kit), "--force", "--passphrase-stdin", input=PASS + "\n")
    assert r.code == 0, r
    assert stat.S_IMODE(kit.stat().st_mode) == 0o600
    assert json.loads(kit.read_text())["vault_id"] == vault.vault_id

    assert vault.keystore.delete(key_entry(vault))
    r = export(tmp_path / "nokey.json")
    assert r.code == 4, r
    assert not (tmp_path / "nokey.json").exists()
    no_secret(key, r)


# --------------------------------------------------------------------------
# On a terminal: hidden prompts, the new passphrase asked twice.
# --------------------------------------------------------------------------
def test_terminal_asks_twice_and_hides_the_passphrase(vault: Any, tmp_path: Path) -> None:
    key = keyring_key(vault)
    kit = tmp_path / "kit.json"
    code, out = run_on_terminal(
        ["key", "export", str(kit)],
        [
            (b"Recovery kit passphrase: ", "first try"),
            (b"Repeat the passphrase: ", "a typo"),
            (b"Recovery kit passphrase: ", PASS),
            (b"Repeat the passphrase: ", PASS),
        ],
    )
    assert code == 0, out
    assert b"do not match" in out
    assert PASS.encode() not in out and b"first try" not in out  # never echoed
    assert key.encode() not in out
    assert stat.S_IMODE(kit.stat().st_mode) == 0o600

    assert vault.keystore.delete(key_entry(vault))
    code, out = run_on_terminal(["key", "import", str(kit)], [(b"Recovery kit passphrase: ", PASS)])
    assert code == 0, out
    assert b"restored key" in out and b"Repeat" not in out
    assert vault.keystore.get(key_entry(vault)) == key


def test_help_of_the_key_commands_has_an_example() -> None:
    for args in (["key"], ["key", "export"], ["key", "import"]):
        r = run_cli(*args, "--help")
        assert r.code == 0, r
        assert "Usage: memvault " + " ".join(args) in r.out and "Example" in r.out
    assert "Exit codes" in run_cli("key", "import", "--help").out


@pytest.mark.slow
@pytest.mark.parametrize(("command", "says"), [("revoke", "revoked"), ("shred", "^no vault at")])
def test_a_revoke_or_shred_racing_an_import_leaves_no_key_behind(
    vault: Any, vault_db: Path, tmp_path: Path, monkeypatch: Any, command: str, says: str
) -> None:
    from vault.errors import VaultError
    from vault.kitops import import_kit

    kit = tmp_path / "kit.json"
    assert export(kit).code == 0
    vault_id = vault.vault_id  # read from the file, which a shred removes
    importer = type(vault).open(vault_db)
    real_get = importer.keystore.get
    raced: list[Any] = []

    def get_after_a_race(name: str) -> Any:
        if not raced:  # another process revokes or shreds between the kit check and the store
            raced.append(run_cli(command, "--yes"))
        return real_get(name)

    monkeypatch.setattr(importer.keystore, "get", get_after_a_race)
    with pytest.raises(VaultError, match=says):
        import_kit(importer, kit, PASS)
    assert raced[0].code == 0, raced[0]
    assert keyring_entries(vault_id) == {}
