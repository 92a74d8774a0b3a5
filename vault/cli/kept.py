"""`memvault key list`, `key forget` and `key rewrap`: the key versions a vault knows,
the ones kept (retained) for its recorded backups, and a transit vault's wrapped keys
moved to its transit key's newest version. Logic in vault.retention, vault.rewrap and
the engines.
"""

from __future__ import annotations

from typing import Any

import click

from vault.cli.common import common, confirm, emit, open_any, say


def backup_lines(backups: list[dict[str, Any]], indent: str = "  ") -> list[str]:
    """One line per recorded backup: where, whether it is there, whether it opens here."""
    from vault.retention import why
    from vault.textsafe import escape_line

    return [indent + escape_line(why(b)) for b in backups]


@click.command("list")
@common
def key_list() -> None:
    """List the key versions this vault's file knows, and the backups that need them.

    State is current (the rows use it), pending (a rotation staged it), retired (a
    rotation replaced it; its entry goes next), retained (replaced, but its entry
    is kept, decrypt-only, because a recorded backup uses it) or destroyed. Under
    each version: the recorded backups that use it, by absolute path, flagged
    "missing" when the file is gone and "replaced" when another file stands there.
    "in keyring" says whether its entry memvault/<vault_id>/<kid> exists: a
    destroyed version still present there is another copy's (a backup restored
    with an older kit); `memvault shred` destroys those too. Never shows a key.

    \b
    Example:
      memvault key list
      memvault key forget mv1:0123456789abcdef   # a retained version, on purpose
    """
    vault = open_any()
    versions = vault.key_versions()
    # Where a present version's key lives: this host's keyring, or wrapped in the vault
    # by its transit key (at this host's VAULT_ADDR/BAO_ADDR).
    where = vault.keystore.name
    wrapped = where.startswith("transit:")
    doc = {
        "vault_id": vault.vault_id,
        "key_source": where if wrapped else f"keyring ({where})",
        "keys": [
            {
                "kid": v.kid,
                "state": v.state,
                "in_keyring": v.in_keyring,
                "where": (f"{where}, wrapped in the vault" if wrapped else "keyring")
                if v.in_keyring
                else None,
                "created_at": v.created_at,
                "backups": list(v.backups),
            }
            for v in versions
        ],
    }

    def human() -> None:
        if wrapped:
            say(f"keys wrapped in the vault by {where}")
        present = "wrapped" if wrapped else "in keyring"
        click.echo(f"{'key id':<22}  {'state':<9}  {present:<10}  created")
        for v in versions:
            present = "yes" if v.in_keyring else "no"
            say(f"{v.kid:<22}  {v.state:<9}  {present:<10}  {v.created_at or 'unknown'}")
            for line in backup_lines(list(v.backups), "    backup "):
                click.echo(line)

    emit(doc, human)


@click.command("forget")
@click.argument("kid", metavar="KID")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def key_forget(kid: str, yes: bool) -> None:
    """Destroy a retained key version on purpose: the backups that use it die.

    A rotation keeps the old version's keyring entry (retained, decrypt-only)
    while a recorded backup uses it. This destroys that entry and drops the
    records of those backups: they can then be read only with a recovery kit
    that holds the version. Names what becomes unreadable and asks first
    (or --yes). Only a retained version can be forgotten. A transit vault's
    backups keep their own wrapped copy: they stay readable until the transit
    key is deleted.

    \b
    Example:
      memvault key list
      memvault key forget mv1:0123456789abcdef --yes
    """
    vault = open_any()
    lost = [
        b for v in vault.key_versions() if v.kid == kid and v.state == "retained" for b in v.backups
    ]
    from vault.keysource.store import is_transit  # see forgotten(): what a transit vault keeps

    transit = is_transit(vault.meta())
    if lost:
        fate = (
            "drops the records of these backups (each keeps its own wrapped copy of the "
            "key and stays readable until the transit key is deleted)"
            if transit
            else "makes these backups unreadable here"
        )
        say(f"forgetting key {kid} {fate}:", err=True)
        for line in backup_lines(lost, "  "):
            click.echo(line, err=True)
    confirm(f"Destroy retained key {kid} of {vault.path}?", yes)
    r = vault.forget(kid)

    def human() -> None:
        say(f"destroyed retained key {r['kid']} of vault {r['vault_id']}")
        for b in r["unreadable"]:
            say(f"  now unreadable here: {b['path']}")
        for b in r["no_longer_recorded"]:
            say(f"  no longer recorded, readable until the transit key is deleted: {b['path']}")

    emit(r, human)


@click.command("rewrap")
@click.option(
    "--raise-min",
    is_flag=True,
    help="Then raise the transit key's min_decryption_version to the safe one (needs the "
    "operator's rights on the key).",
)
@common
def key_rewrap(raise_min: bool) -> None:
    """Move a transit vault's wrapped keys to the transit key's newest version.

    Run it after the operator rotated the transit key (bao write -f
    transit/keys/KEYNAME/rotate). No plaintext changes and no key leaves the
    service, so it asks nothing. It says which min_decryption_version is now
    safe: the oldest transit version still needed by a wrapped key of the vault
    or of a recorded backup (backups hold their own wrapped copies).

    \b
    Example:
      memvault key rewrap
      memvault key rewrap --raise-min
    """
    from vault.rewrap import rewrap

    r = rewrap(open_any(), raise_min)

    def human() -> None:
        moved = ", ".join(r["rewrapped"]) or "none (all were at the newest version)"
        say(f"rewrapped by {r['transit_key']}: {moved}")
        for path in r["backups_holding_older_versions"]:
            say(f"  backup {path} holds keys wrapped by an older transit version")
        for path in r["backups_not_read"]:
            say(f"  backup {path} could not be read: its transit versions are not counted")
        safe = r["safe_min_decryption_version"]
        if r["min_decryption_version"] is not None:
            say(f"min_decryption_version is now {r['min_decryption_version']}")
        elif safe is not None:
            say(
                f"min_decryption_version {safe} is safe now; raise it with "
                "`memvault key rewrap --raise-min` (operator) or bao write "
                f"transit/keys/KEYNAME/config min_decryption_version={safe}"
            )

    emit(r, human)


@click.command("move")
@click.argument("target", metavar="SOURCE")
@click.option(
    "--transit-mount",
    default=None,
    metavar="PATH",
    help="The transit engine's mount, with transit:KEYNAME (default transit).",
)
@common
def key_move(target: str, transit_mount: str | None) -> None:
    """Move the vault's keys to another key source: keyring, or transit:KEYNAME.

    Every key version the vault needs moves: first put in the new source (this
    host's keyring, or wrapped by the transit key, which is created if missing),
    then the vault switches to it in one transaction, then this host's keyring
    entries of a vault now in transit are deleted (not those a recorded backup
    still reads). A kill at any point leaves the vault readable through one
    source or the other; run the same command again to finish. Never shows a key.

    \b
    Example:
      memvault key move transit:memvault-laptop-42
      memvault key move keyring
    """
    from vault.keymove import move

    r = move(open_any(), target, transit_mount)

    def human() -> None:
        if r["already"]:
            say(f"vault {r['vault_id']} already keeps its keys in {r['to']}")
        else:
            say(f"moved keys {', '.join(r['moved'])} of vault {r['vault_id']} to {r['to']}")
        if r["removed_from_keyring"]:
            say(f"  removed from this keyring: {', '.join(r['removed_from_keyring'])}")
        if r["kept_in_keyring"]:
            say(f"  kept in this keyring for recorded backups: {', '.join(r['kept_in_keyring'])}")

    emit(r, human)
