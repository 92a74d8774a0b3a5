"""`memvault` commands that read the history out: export and search.

Logic in vault.export and vault.search; neither imports the Agents SDK.
"""

from __future__ import annotations

import sys

import click

from vault.cli.common import (
    SESSION,
    common,
    emit,
    open_any,
    plural,
    refuse_option,
    refuse_vault_target,
    say,
    state,
)
from vault.errors import VaultError

# vault.export's FORMATS, spelled here so that loading the CLI does not import the
# export and search modules (~8 ms on every command); a test keeps the two equal.
FORMATS = ("jsonl", "md")

PLAINTEXT_WARNING = (
    "warning: the export is plaintext, no longer protected by the vault's key; keep it "
    "private and delete it when done"
)


def _unreadable(n: int, session_word: str, what: str) -> VaultError:
    """The line after the result when items did not authenticate (exit 1, as `show`)."""
    return VaultError(
        f"{plural(n, 'item')} of {session_word} failed authentication (tampered, corrupt or "
        f"sealed with another key) and {'was' if n == 1 else 'were'} not {what}; "
        "nothing was changed"
    )


@click.command("export")
@click.argument("session_ids", nargs=-1, metavar="[SESSION]...", type=SESSION)
@click.option("--all", "all_sessions", is_flag=True, help="Export every session.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="jsonl",
    show_default=True,
    help="jsonl: one JSON item per line; md: Markdown for reading.",
)
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    metavar="FILE",
    help="A new file (mode 0600), or - for stdout.",
)
@click.option(
    "--force", is_flag=True, help="Replace FILE if it is an earlier export (or an empty file)."
)
@click.option("--include-expired", is_flag=True, help="Also export items past the TTL.")
@click.option(
    "--include-tampered",
    is_flag=True,
    help="Also export a session whose history does not verify, marked as tampered.",
)
@common
def export_cmd(
    session_ids: tuple[str, ...],
    all_sessions: bool,
    fmt: str,
    output: str,
    force: bool,
    include_expired: bool,
    include_tampered: bool,
) -> None:
    """Write the decrypted history of SESSIONs (or --all) to FILE, in plaintext.

    jsonl gives one line per item: {"session_id", "position", "timestamp",
    "expired", "item"}, where position counts every stored item of the session
    (1 = oldest) and timestamp is when the item was sealed (UTC). md gives one
    section per session, tool calls and outputs shortened.

    FILE is created mode 0600 and never written through a symbolic link; an
    existing FILE is refused unless --force, which replaces only an earlier
    export (a file starting with "# memvault export" or with a JSONL record of
    this command) or an empty file. A link, FIFO, folder, SQLite database, or
    the vault or its -wal, -shm, -journal (by any name) is always refused:
    exit 2. Items past the TTL are left out unless --include-expired. Items
    that fail authentication are never written: they are counted, and the
    command then exits 1. A session whose history chain does not verify
    (reordered, replayed, cut) is refused, exit 1, unless --include-tampered,
    which marks it ("tampered" in each JSONL record, a line in md). A line on
    stderr always says the output is plaintext.
    With -o -, the export goes to stdout and --json is refused.

    \b
    Example:
      memvault export carnet-local -o carnet.jsonl
      memvault export --all --format md -o history.md
    """
    to_stdout = output == "-"
    if to_stdout and state().json:
        refuse_option(
            "--json", "export -o -", "stdout carries the export; write to a file for the summary"
        )
    from vault.export import plan_export, run_export
    from vault.targets import over_vault

    refuse_vault_target(None if to_stdout else output, over_vault("export"))
    vault = open_any()
    plan = plan_export(
        vault,
        session_ids,
        all_sessions,
        None if to_stdout else output,
        fmt,
        force,
        include_expired,
        include_tampered,
    )
    click.echo(PLAINTEXT_WARNING, err=True)
    stream = sys.stdout.buffer if to_stdout else None
    r = run_export(vault, plan, stream)

    def human() -> None:
        where = "stdout" if r.path is None else f"{r.path} (mode 0600)"
        line = (
            f"exported {plural(r.items, 'item')} of {plural(len(r.sessions), 'session')} "
            f"as {r.format} to {where}"
        )
        if r.expired_skipped:
            line += (
                f"; {plural(r.expired_skipped, 'expired item')} left out (--include-expired "
                "adds them)"
            )
        say(line, err=to_stdout)

    emit(r.as_dict(), human)
    if r.unreadable:
        raise _unreadable(r.unreadable, "the exported sessions", "exported")


@click.command("search")
@click.argument("pattern")
@click.argument("session_ids", nargs=-1, metavar="[SESSION]...", type=SESSION)
@click.option("--regex", is_flag=True, help="PATTERN is a Python regular expression.")
@click.option("--include-expired", is_flag=True, help="Also search items past the TTL.")
@common
def search_cmd(
    pattern: str, session_ids: tuple[str, ...], regex: bool, include_expired: bool
) -> None:
    """Find the items whose text contains PATTERN, in SESSIONs (default: all).

    Case-insensitive, as a plain substring, or as a Python regular expression
    with --regex (write (?-i:...) for a case-sensitive part). The text of an
    item is a message's content, a tool call's name and arguments, a tool's
    output. One line per matching item: session, #position (as in `export`),
    role, excerpt. Items are decrypted and scanned in memory: no index is
    built and nothing is written to disk. A PATTERN that starts with - goes
    after --.

    \b
    Exit codes:
      0  at least one item matched
      1  no item matched (as grep), or some items failed authentication
         (then a line on stderr says how many)
      2  bad PATTERN (empty, or a regex that does not compile)

    \b
    Example:
      memvault search nord-17
      memvault search --regex 'NORD-\\d+' carnet-local --json
      memvault search -- --force
    """
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise click.BadParameter(
            "the pattern is not valid UTF-8 text (a stray byte from the shell?)",
            param_hint="PATTERN",
        ) from None
    from vault.search import search

    found = search(open_any(), pattern, session_ids, regex, include_expired)

    def human() -> None:
        for h in found.hits:
            say(f"{h.session_id} #{h.position} {h.role}: {h.excerpt}")
        if not found.hits and not found.unreadable:
            line = (
                f"no item matches {pattern!r} ({plural(found.items, 'item')} searched in "
                f"{plural(len(found.sessions), 'session')}"
            )
            if found.expired_skipped:
                line += f"; --include-expired also searches {found.expired_skipped} expired"
            say(line + ")", err=True)

    emit(found.as_dict(), human)
    if found.unreadable:
        raise _unreadable(found.unreadable, "the searched sessions", "searched")
    if not found.hits:
        click.get_current_context().exit(1)  # as grep: a script can test for a match


COMMANDS = (
    export_cmd,
    search_cmd,
)
