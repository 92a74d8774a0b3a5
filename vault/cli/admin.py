"""`memvault` commands that rewrite or destroy: purge, rotate, revoke and shred (a file or
a PostgreSQL vault: vault.engines.postgres.admin says what differs)."""

from __future__ import annotations

import json
from typing import Any

import click

from vault.backupmark import refuse_writes
from vault.cli.common import (
    PATH,
    check_scrub,
    common,
    confirm,
    emit,
    open_any,
    plural,
    postgres_url,
    progress,
    progress_bar,
    say,
    state,
)
from vault.engines.sqlite.vault import shred
from vault.errors import OperationFailed


@click.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def purge(yes: bool) -> None:
    """Physically delete items past the TTL (only items that authenticate).

    \b
    Example:
      memvault purge --yes
    """
    vault = open_any()
    refuse_writes(vault, "`memvault purge`")  # before anything is asked
    vault.sealer()
    if not yes:
        # Counted from timestamps (unverified): purge itself deletes only what authenticates.
        expired = sum(s.expired_unverified for s in vault.sessions())
        if expired:  # with nothing to delete there is nothing to ask
            confirm(
                f"Delete the {plural(expired, 'expired item')} of the vault {vault.path} for good?",
                yes,
            )
    with progress(vault.count_items(), "purging") as bar:
        report = vault.purge(progress=bar)
    doc = {**report.counts, **report.notes, "scrubbed": report.scrubbed}
    # An engine whose scrub is not memvault's to do (PostgreSQL) says what became of the rows.
    note = f"\nscrub: {doc['scrub']}" if "scrub" in doc and doc["deleted"] else ""
    if "tampered" in doc:  # their rows stay: `memvault verify` names what is wrong
        note += f"\nleft as they are, their history does not verify: {doc['tampered']}"
    emit(
        doc,
        lambda: click.echo(
            f"purged {plural(report.counts['deleted'], 'expired item')}; kept "
            f"{plural(report.counts['kept'], 'item')}"
            + (
                f"; {plural(report.counts['unreadable'], 'unreadable item')} left untouched"
                if report.counts["unreadable"]
                else ""
            )
            + note
        ),
    )
    check_scrub(report.scrubbed)


def _kept_note(c: dict[str, Any]) -> str:
    """What became of the old key, and which recorded backups still open, and why."""
    from vault.cli.kept import backup_lines

    if c.get("old_key") == "retained":
        head = f"\n  old key {c['old_kid']} retained (decrypt-only) for the backups that use it"
    else:
        head = f"\n  old key {c['old_kid']} destroyed: no recorded backup uses it"
    lines = backup_lines(c.get("backups", []), "  backup ")
    return head + "".join("\n" + line for line in lines)


@click.command()
# Accepted as on every command that can ask, so that scripts pass it without
# knowing which ones ask today.
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def rotate(yes: bool) -> None:
    """Replace the key: re-encrypt every item, keep timestamps, scrub old bytes.

    Older recovery kits stop working after a rotation: export a new one.

    \b
    Example:
      memvault rotate --json
    """
    vault = open_any()
    vault.sealer()
    with progress(vault.count_items(), "rotating") as bar:
        report = vault.rotate(progress=bar)
    c = {**report.counts, **report.notes}
    # Its own field: a kit made before this rotation lacks the new key.
    c["kit_reminder"] = "older recovery kits no longer match: run `memvault key export` again"
    note = f"\n  scrub   {c['scrub']}" if "scrub" in c else ""
    emit(
        c,
        lambda: click.echo(
            f"rotated {plural(c['items'], 'item')} in {plural(c['sessions'], 'session')} "
            f"in {c['seconds']}s\n"
            f"  key id  {c['old_kid']} -> {c['new_kid']}\n"
            f"  expired {c['expired']}, unreadable {c['unreadable']}\n"
            f"  {c['kit_reminder']}"
            + note
            + _kept_note(c)
            # An online rotation under way (another host's) is joined, not started anew.
            + ("\n  finished a rotation already under way" if c.get("resumed") else "")
        ),
    )
    check_scrub(report.scrubbed)


@click.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def revoke(yes: bool) -> None:
    """Destroy the key. The file stays, unreadable for ever (cryptographic erase).

    On a PostgreSQL vault the rows stay, and only this host's keyring entries
    go: run it on every host that holds the key.

    \b
    Example:
      memvault revoke --yes && memvault shred --yes
    """
    vault = open_any()
    refuse_writes(vault, "`memvault revoke`")  # before anything is asked
    confirm(
        f"Destroy the key of the vault {vault.path}? Its history can never be read again",
        yes,
    )
    r = vault.revoke()
    stays = vault.stays  # "file" or "rows"
    where, removes = ("file stays", "it") if stays == "file" else (f"{stays} stay", "them")
    hosts = f"; {r['other_hosts']}" if "other_hosts" in r else ""
    if r.get("transit_key") == "deleted":
        hosts += "; its transit key is deleted: no copy of the vault can be unwrapped"
    elif r.get("transit_key") == "kept":
        hosts += "; " + r["transit_key_fix"]
    if "anchor_fix" in r:
        hosts += "; its anchor (nothing secret) stays in the key service: " + r["anchor_fix"]

    def human() -> None:
        if r["already_revoked"]:
            finished = ""
            if r["key_destroyed"]:
                # A second host's revoke, or one finishing a revoke cut off: either way
                # what happened is that this keyring still held the key, and now does not.
                finished = f"; this keyring still held its key: destroyed it ({_kids(r)})"
            say(
                f"vault {r['vault_id']} was already revoked (key {r['kid']}){finished}; "
                f"`memvault shred` removes the {stays}" + hosts
            )
            return
        say(
            f"revoked key {r['kid']} of vault {r['vault_id']} (destroyed: {_kids(r)}); the "
            f"{where}, unreadable; `memvault shred` removes {removes}; recovery kits are "
            "useless now" + hosts
        )

    emit(r, human)


@click.command("shred")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--receipt",
    metavar="FILE",
    type=PATH,
    help="Write a JSON record of what was destroyed to FILE, a new file (mode 0600).",
)
@common
def shred_cmd(yes: bool, receipt: str | None) -> None:
    """Destroy the key, the rows and the files (database, -wal, -shm, -journal).

    Works without the key, and on a damaged file SQLite cannot read (then only
    the keys its bytes still name can be destroyed; the report says so). Only
    regular files are overwritten: a symbolic link, FIFO or device at a side
    file's name is removed without being followed. On SSDs and copy-on-write
    filesystems overwriting is not a guarantee; destroying the key is (see
    SECURITY.md).

    On a PostgreSQL vault (a URL): the key versions, then the rows (VACUUM
    after), the vault's tables, and the URL's schema if `memvault init` created it and
    nothing else is in it (never `public` or a schema made by someone else). There
    are no files to overwrite: the report says so. Only this host's keyring
    entries go: run `memvault revoke --yes` on every other host first.

    --receipt FILE must name a new file in an existing, writable folder: an
    existing file or link is never replaced, and FILE is never the vault or one
    of its -wal, -shm, -journal files, by any name. It is checked before anything is
    destroyed (exit 2 if unusable).

    \b
    Example:
      memvault shred --yes --receipt shred-receipt.json
    """
    from vault.engines.sqlite.shred import regular_files, shred_target
    from vault.targets import check_target

    if postgres_url() is not None:
        # The one branch left: a file is shredded by its path, without opening it as a
        # vault (a damaged or revoked file too) and with its files overwritten; a
        # PostgreSQL vault is opened, and its tables dropped.
        _shred_postgres(yes, receipt)
        return
    target = shred_target(state().db)  # no vault, nothing asked (exit 3)
    path = target["path"]
    if receipt is not None:
        check_target(receipt, "receipt", path)
    named = f" {target['vault_id']}" if target["vault_id"] else ""
    confirm(f"Destroy the vault{named} at {path}, its key and its files?", yes)
    size = sum(n for _, n in regular_files(path))
    with progress_bar(size, "overwriting") as bar:

        def resize(total: int) -> None:
            bar.length = max(total, 1)  # the checkpoint may have emptied the WAL

        r = shred(path, progress=bar.update if bar else None, on_total=resize if bar else None)
    failure = _write_receipt(receipt, r)
    emit(r, lambda: say(_shred_summary(r)))
    if failure:
        raise OperationFailed(failure)


def _shred_postgres(yes: bool, receipt: str | None) -> None:
    """`shred` on a URL: key, rows, tables; no files to overwrite (engines.postgres.shred)."""
    from vault.targets import check_target

    vault = open_any()  # no vault: exit 3 before anyone is asked
    if receipt is not None:
        check_target(receipt, "receipt", None)
    confirm(f"Destroy the vault {vault.vault_id} at {vault.path}, its key and its tables?", yes)
    r = vault.shred()
    r["other_hosts"] = (
        "this host's keyring entries of the vault were destroyed; other hosts keep theirs "
        "(run `memvault revoke --yes` on each before a shred; afterwards delete "
        f"memvault/{r['vault_id']}/<kid> there, e.g. `keyring del memvault {r['vault_id']}/KID`)"
    )
    failure = _write_receipt(receipt, r)

    def human() -> None:
        key = f"destroyed ({_kids(r)})" if r.get("key_destroyed") else "already gone"
        schema = "dropped" if r["schema_dropped"] else f"kept ({r['schema_kept_because']})"
        say(
            f"shredded {r['path']}: {r['items']} item(s) in {r['sessions']} session(s); key "
            f"{key}; tables {', '.join(r['tables_dropped'])} deleted, VACUUMed and dropped; "
            f"schema {r['schema']} {schema}",
            f"files: {r['files_note']}",
            f"other hosts: {r['other_hosts']}",
        )

    emit(r, human)
    if failure:
        raise OperationFailed(failure)


def _write_receipt(receipt: str | None, r: dict[str, Any]) -> str | None:
    """Write shred's report to the receipt file; the message to raise if it could not be."""
    from vault.files import write_private

    if receipt is None:
        return None
    try:
        write_private(receipt, (json.dumps(r, indent=2, sort_keys=True) + "\n").encode())
    except OSError as exc:
        return (
            f"the vault was shredded, but the receipt {receipt} could not be written "
            f"({exc.strerror}); keep the summary printed above instead"
        )
    return None


def _shred_summary(r: dict[str, Any]) -> str:
    def one(f: dict[str, Any]) -> str:
        if f.get("kind", "file") == "file":
            return f"{f['name']} ({f['size']} bytes)"
        return f"{f['name']} ({f['kind']} removed, not followed)"

    if r.get("items") is None:
        counts = "damaged file, contents not counted"
    else:
        counts = f"{r['items']} item(s) in {r['sessions']} session(s)"
    key = f"destroyed ({_kids(r)})" if r.get("key_destroyed") else "already gone"
    if r.get("keys_kept"):
        key = r["keys_kept"]
    if r.get("key_problem"):
        key = f"not destroyed: {r['key_problem']}"
    return f"shredded {r['path']}: {counts}; key {key}; files " + ", ".join(
        one(f) for f in r["files"]
    )


def _kids(r: dict[str, Any]) -> str:
    """The key versions a revoke or shred destroyed, naming those of other copies."""
    kids = r.get("destroyed_kids") or []
    text = ", ".join(kids) or "none left"
    others = r.get("other_copies_kids") or []
    if others:
        text += f"; {', '.join(others)} still opened another copy of this vault"
    return text


COMMANDS = (
    purge,
    rotate,
    revoke,
    shred_cmd,
)
