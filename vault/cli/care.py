"""`memvault` commands that look after the vault file: backup, verify, restore, accept.

Logic in vault.engines.sqlite.backup, vault.verify, vault.engines.sqlite.restore and
vault.engines.sqlite.accepting; none imports the Agents SDK.
"""

from __future__ import annotations

import click

from vault.backupmark import refuse_writes
from vault.cli.common import (
    PATH,
    common,
    confirm,
    emit,
    open_any,
    plural,
    refuse_vault_target,
    say,
    state,
)
from vault.errors import KeyProblem, OperationFailed


@click.command("backup")
@click.argument("dest", metavar="DEST")
@common
def backup_cmd(dest: str) -> None:
    """Write a consistent copy of the vault to DEST, a new file (mode 0600).

    Safe while agents are writing: SQLite's VACUUM INTO copies one snapshot
    (the WAL included) into fresh pages, so the copy holds no free pages and
    no residue of deleted items. The copy keeps the vault id and the key id:
    it opens with the same keyring key, and no key is copied into it. To
    restore it on another machine you also need a recovery kit (`memvault key
    export`); the command prints the steps.

    A vault whose key is missing from this keyring is still backed up, with a
    warning (a recovery kit may hold the key); a revoked vault is refused
    (exit 4). DEST must not exist: an existing file, link or FIFO is refused
    (exit 2) and left untouched, and so is the vault itself or its -wal, -shm
    or -journal, by any name (a link, a relative path). The copy is marked as a
    backup: commands that write (rotate, purge, clear, pop, ttl, import, revoke,
    an agent's session) refuse it; `memvault restore DEST` makes it the live
    vault again. `memvault --db DEST shred` destroys the copy but keeps the key
    versions it shares with the live vault.

    On a PostgreSQL vault (--db URL), DEST is a new vault file (SQLite) holding
    one snapshot of it, rows as they are, opened with the same keyring entry;
    for a server-side backup use pg_dump.

    \b
    Example:
      memvault backup ~/backups/history-2026-11-30.db
      memvault --json backup /media/usb/history.db
    """
    from vault.targets import over_vault

    refuse_vault_target(dest, over_vault("backup"))
    vault = open_any()
    r = vault.backup(dest)

    def human() -> None:
        say(
            f"backed up vault {r.vault_id} to {r.path}",
            f"  {plural(r.items, 'item')} in {plural(r.sessions, 'session')}, "
            f"{r.size} bytes, mode {r.mode}",
            f"  key id  {r.kid} (the key is not in the backup)",
            "to restore it on another machine:",
            *(f"  {step}" for step in r.restore),
        )
        if vault.backup_note:
            click.echo(vault.backup_note)

    emit(r.as_dict(), human)
    if r.key_problem:
        say(
            f"warning: the backup is made, but this keyring cannot open it ({r.key_problem}); "
            f"it opens only with a recovery kit for key {r.kid}",
            err=True,
        )
    if not r.audited:
        click.echo(
            "warning: the backup is made, but the vault was busy and its audit trail does not "
            "record it",
            err=True,
        )


@click.command("verify")
@common
def verify_cmd() -> None:
    """Check everything: file integrity, every item, guard triggers, meta, key.

    Runs SQLite's integrity check, authenticates every item under the key
    (in batches), checks the guard triggers against the ones memvault creates,
    the meta rows and the recorded migrations. It changes nothing (unlike
    other commands, it neither migrates nor finishes a pending scrub). On a
    PostgreSQL vault the integrity check and the scrub do not apply; the guard
    trigger and its function are compared, and a rotation in progress is shown.

    \b
    Exit codes:
      0  every check passed
      1  problems found: each is listed with its count and what to do
      3  no vault at that path
      4  the key is missing, revoked or does not match: the other checks are
         still reported, but the items could not be verified

    \b
    Example:
      memvault verify
      memvault --db backup.db --json verify
    """
    from vault.engines.registry import verify_vault
    from vault.verify import VerifyReport

    report: VerifyReport = verify_vault(state().db)  # read-only: not through open_any
    doc = report.as_dict()
    rotation = doc.get("rotation")

    def human() -> None:
        say(f"vault      {report.path}  ({report.vault_id or 'no vault id'})")
        key = report.key + (f", key id {report.kid}" if report.kid else "")
        if report.key_error:
            key = f"{report.key}: {report.key_error.message}"
        say(f"key        {key}")
        counts = f"{plural(report.items, 'item')} in {plural(report.sessions, 'session')}"
        if report.authenticated is None:
            counts += f": not authenticated ({report.unverified_reason})"
        else:
            counts += f": {report.authenticated} authenticate ({report.expired} expired)"
        say(f"items      {counts}")
        if rotation:
            say(
                f"rotation   in progress from key {rotation['from_kid']} (rows through id "
                f"{rotation['done_through_id']} moved; both keys read); `memvault rotate` "
                "finishes one that was cut off"
            )
        checked = report.CHECKED
        if report.authenticated is not None:
            checked += ", every item"
        click.echo(f"checked    {checked}{report.CHECKED_NOTE}")
        found = {k: n for k, n in report.problems.items() if n}
        if report.ok:
            click.echo("result     ok")
        elif not found:
            click.echo("result     not verified: the items need the key")
        else:
            click.echo(f"result     {plural(sum(found.values()), 'problem')}")
        for kind, n in found.items():
            label, fix = report.problem_texts[kind]
            click.echo(f"  {kind} ({n}): {label}")
            shown = report.details.get(kind, [])
            for detail in shown:
                say(f"      {detail}")
            if n > len(shown):
                click.echo(f"      ... and {n - len(shown)} more")
            click.echo(f"    what to do: {fix}")

    emit(doc, human)
    if report.key_error is not None:
        raise KeyProblem(f"{report.key_error.message}; the items were not verified")
    if not report.ok:
        found = ", ".join(f"{kind} {n}" for kind, n in report.problems.items() if n)
        where = "the JSON document" if state().json else "the list above"
        raise OperationFailed(f"verify found problems in {report.path}: {found}; see {where}")


# After `accept` or `restore`, when the record of the new state did not reach the anchor.
ANCHOR_NOT_MOVED = (
    "warning: {done}, but the record of its state outside the file (in the keyring, or the "
    "key service) could not be moved, so the vault may still be reported as rolled back; "
    "run `memvault --db {path} accept --yes` once the keyring or key service answers"
)


@click.command("restore")
@click.argument("backup", metavar="BACKUP", type=PATH)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def restore_cmd(backup: str, yes: bool) -> None:
    """Make BACKUP (a file `memvault backup` wrote, or a copy) the live vault at --db.

    BACKUP must be a copy of the vault at --db (same vault id), or of a vault
    that is no longer there (restore to a path with no vault only when the
    original is gone: both would share one set of keys; refused while the vault
    a backup was made from is still at its path, and for a PostgreSQL vault's
    backup), and every item must authenticate with the keys in
    this keyring (`memvault --db BACKUP key import KIT` first if it needs an
    older key). The restored vault is a new compact copy of BACKUP, no longer
    marked as a backup; BACKUP itself stays as it is.

    Crash-safe: the vault being replaced stays whole under its name until the
    copy is complete, then is overwritten and deleted; a restore cut off at any
    point is rolled back or finished by the next command that opens the vault.
    Refuses (exit 5) while another process has the vault open. Items the
    vault got after the backup was made are gone once it is restored: export
    them first if you need them.

    On a PostgreSQL vault (--db URL), BACKUP is a file `memvault backup` wrote
    from it: its sessions and items replace the vault's in one transaction,
    under the lock rotate takes (refused while a rotation is unfinished), and
    the vault uses the backup's key again until the next rotate. A backup of
    another vault is refused with exit 2.

    \b
    Exit codes:
      1  BACKUP is of another vault, does not verify, or the answer was no
      2  BACKUP is of another vault than the PostgreSQL vault at --db
      3  no vault at BACKUP, or --db names a file that is not a vault
      4  the keyring cannot open every item of BACKUP
      5  the vault is in use by another process

    \b
    Example:
      memvault restore ~/backups/history-2026-11-30.db
      memvault --db ~/work/history.db restore /media/usb/history.db --yes
    """
    from vault.engines.registry import check_restore

    todo = check_restore(state().db, backup)
    plan = todo.plan
    if plan.replaces:
        confirm(
            f"Replace the vault at {plan.path} ({plural(plan.replaced_items or 0, 'item')}) with "
            f"the backup {plan.source} ({plural(plan.items, 'item')}, made "
            f"{plan.backed_up_at or 'at an unknown time'})? Items written since are lost",
            yes,
        )
    r = todo.run()

    def human() -> None:
        say(
            f"restored vault {r['vault_id']} at {r['path']} from {r['source']}",
            f"  {plural(r['items'], 'item')} in {plural(r['sessions'], 'session')}, key id "
            f"{r['kid']}; checked: {', '.join(r['checked'])}",
            "  the replaced vault was overwritten and deleted"
            if not todo.in_place and r["replaces"]
            else "  its sessions and items were replaced in one transaction"
            if todo.in_place
            else "  there was no vault at that path",
        )
        if todo.in_place and r["replaced_kid"] != r["kid"]:
            say(
                f"  the vault uses the backup's key {r['kid']} again; the replaced key "
                f"{r['replaced_kid']} is {r['old_key']}; `memvault rotate` moves every item "
                "to a fresh key, and hosts without the backup's key need a recovery kit"
            )

    emit(r, human)
    if not r.get("anchored", True):
        say(ANCHOR_NOT_MOVED.format(done="the backup is restored", path=r["path"]), err=True)


@click.command("accept")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def accept_cmd(yes: bool) -> None:
    """Take the vault's sessions as they stand now as its authenticated state.

    The vault head sums every session's head under the key. When `verify` says
    "the vault as a whole: a session put back from an older copy, added or
    removed whole", no single session can be named, and every agent session,
    `show` and `export` refuse the vault. When it says "the whole vault put
    back from an older copy", the file is older than the state memvault
    recorded in the keyring (a copy put back with `cp`). Restore a backup
    (`memvault restore`) or put the newer file back if you have one; otherwise
    look at what is there (`show SESSION --include-tampered`) and accept it: the
    vault head is summed afresh over the sessions as they are, past the recorded
    state, which moves to it, and they are served again. A session whose own
    head is forged is refused first: `clear SESSION --include-unreadable`
    deletes it on purpose. Backups are refused: each is judged as it was made.
    When the keyring (or key service) fails to take the new state, a warning
    says so: run accept again once it answers.

    \b
    Exit codes:
      1  a session's own head is forged, the file is a backup, the vault is a
         PostgreSQL vault (no history chain yet), or the answer was no
      3  no vault at that path
      4  the key is missing, revoked or does not match
      5  the vault is busy: another process holds its write lock

    \b
    Example:
      memvault verify
      memvault accept --yes
    """
    vault = open_any()
    refuse_writes(vault, "`memvault accept`")  # before anything is asked
    confirm(
        f"Accept every session of {vault.path} as it stands now as the vault's state? "
        "A session put back from an older copy, added or removed whole stays as it is",
        yes,
    )
    r = vault.accept_history()

    def human() -> None:
        say(
            f"accepted {plural(r.sessions, 'session')} of {vault.path} as the vault's state"
            + ("" if not r.matched else " (it was that state already)")
        )

    data = {"path": str(vault.path), "sessions": r.sessions, "matched": r.matched}
    emit({**data, "anchored": r.anchored}, human)
    if not r.anchored:
        done = "the state is accepted in the file"
        say(ANCHOR_NOT_MOVED.format(done=done, path=vault.path), err=True)


COMMANDS = (
    backup_cmd,
    verify_cmd,
    restore_cmd,
    accept_cmd,
)
