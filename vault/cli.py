"""The `memvault` command: parse arguments, call the library, print.

Logic lives in `vault.store`; this module only formats. `main` is the single
place that maps a `VaultError` (or a Click usage error) to one line on stderr
and its exit code. The Agents SDK is imported only by `demo` and `chat`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from . import __version__, durations
from .errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Interrupted,
    OperationFailed,
    VaultBusy,
    VaultError,
)
from .store import DEFAULT_TTL, Progress, Vault, lock_timeout, shred

F = TypeVar("F", bound=Callable[..., Any])


# ----------------------------------------------------------------------------
# Shared options: --db, --json, --version and --help work before or after the
# command name.
# ----------------------------------------------------------------------------
class State:
    def __init__(self) -> None:
        self.db: str | None = None
        self.json = False
        self.emitted = False  # a result document is on stdout already


# SQLite binds integers as 64-bit: a larger count is a usage error, not an OverflowError.
MAX_COUNT = 2**63 - 1


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """`1 item`, `2 items`: every count in a human message goes through here."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def iso_utc(stamp: str | None) -> str | None:
    """SQLite's CURRENT_TIMESTAMP ("YYYY-MM-DD HH:MM:SS", UTC) in the format used
    everywhere else (store.utcnow: "YYYY-MM-DDTHH:MM:SSZ")."""
    if not stamp or "T" in stamp:
        return stamp
    return stamp.replace(" ", "T", 1) + ("" if stamp.endswith("Z") else "Z")


class SessionId(click.ParamType):  # type: ignore[type-arg]
    """A session id: text. Bytes that are not UTF-8 (`$'\\xff'`) reach Python as lone
    surrogates, which SQLite cannot store: refused as a usage error."""

    name = "session"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                self.fail(
                    "the session id is not valid UTF-8 text (a stray byte from the shell?); "
                    "give it as text",
                    param,
                    ctx,
                )
        return value


SESSION = SessionId()


def _remember_db(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(State).db = value


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(State).json = True


def common(fn: F) -> F:
    fn = click.version_option(__version__, "--version", prog_name="memvault")(fn)
    fn = click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_remember_json,
        help="Print one JSON document on stdout.",
    )(fn)
    fn = click.option(
        "--db",
        metavar="PATH",
        expose_value=False,
        callback=_remember_db,
        help="Vault file (default: $MEMVAULT_DB, else the platformdirs data folder).",
    )(fn)
    return fn


def state() -> State:
    return click.get_current_context().ensure_object(State)


def open_vault() -> Vault:
    return Vault.open(state().db)


def emit(data: Any, human: Callable[[], None]) -> None:
    """JSON on stdout with --json, else the human rendering."""
    if state().json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        state().emitted = True
    else:
        human()


def confirm(question: str, yes: bool) -> None:
    """Ask before a destructive step. "n" is exit 1; Ctrl-C is exit 130 (Interrupted)."""
    if yes:
        return
    try:
        answer = click.confirm(question, err=True)
    except click.exceptions.Abort as exc:
        if not sys.stdin.isatty():
            click.echo(err=True)  # piped answers are not echoed: end the question's line
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise Interrupted("interrupted at the question; nothing was changed") from None
        raise
    if not answer:
        raise click.exceptions.Abort()


@contextmanager
def progress(length: int, label: str) -> Iterator[Progress | None]:
    """A progress bar on a terminal; silence (and no cost) otherwise."""
    with _bar(length, label) as bar:
        yield bar.update if bar else None


@contextmanager
def _bar(length: int, label: str) -> Iterator[Any]:
    if not sys.stderr.isatty() or length <= 0:
        yield None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
        yield bar


def check_scrub(vault: Vault) -> None:
    """After the result is printed: exit 5 if old bytes may still be in the files.

    The change itself is committed; the next memvault command finishes the scrub.
    """
    if vault.scrub_incomplete:
        raise VaultBusy(
            "the change is committed, but the scrub is incomplete: another process holds a "
            "read transaction, so replaced ciphertext may remain in the WAL; the next memvault "
            "command finishes it"
        )


def duration(_ctx: click.Context | None, _param: click.Parameter | None, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return ("set", durations.parse_duration(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


# ----------------------------------------------------------------------------
# The group and the error mapping
# ----------------------------------------------------------------------------
class VaultGroup(click.Group):
    """Turns every failure into one line on stderr and its documented exit code."""

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        standalone = standalone_mode
        st = extra.setdefault("obj", State())
        raw = [str(a) for a in (sys.argv[1:] if args is None else args)]
        # Before the command line is parsed (or when parsing fails) --json is not known
        # yet: look for it among the options, as the parser would.
        raw_json = "--json" in raw[: raw.index("--")] if "--" in raw else "--json" in raw

        def fail(message: str, code: int, usage: bool = False) -> None:
            # One document on stdout: a failure after the result (exit 5, scrub pending;
            # show's unreadable items) keeps the result as the document.
            as_json = bool(getattr(st, "json", False)) or (usage and raw_json)
            as_json = as_json and not getattr(st, "emitted", False)
            _fail(message, code, as_json)

        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except NO_ARGS_IS_HELP as exc:  # `memvault` or `memvault key` alone: the help
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            rv = EXIT_OK
        except click.exceptions.UsageError as exc:
            hint = ""
            if exc.ctx is not None:
                hint = f"; see `{exc.ctx.command_path} --help`"
            fail(f"{_one_line(exc.format_message()).rstrip('.')}{hint}", exc.exit_code, True)
        except click.exceptions.Abort as exc:
            # Click's own main turns a KeyboardInterrupt anywhere into Abort: a Ctrl-C,
            # not a refusal. (Prompts and rotate raise Interrupted with a precise line.)
            if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
                fail("interrupted; the last committed state is intact", EXIT_INTERRUPTED)
            fail("aborted; nothing was changed (pass --yes to skip the question)", EXIT_FAILED)
        except click.exceptions.ClickException as exc:
            fail(_one_line(exc.format_message()), exc.exit_code)
        except VaultError as exc:
            fail(_one_line(exc.message), exc.exit_code)
        except KeyboardInterrupt:
            fail("interrupted; the last committed state is intact", EXIT_INTERRUPTED)
        except BrokenPipeError:
            sys.stderr.close()
            sys.exit(EXIT_FAILED)
        except Exception as exc:  # a bug: still one line, never a traceback or a secret
            if os.environ.get("MEMVAULT_DEBUG"):
                raise
            fail(
                f"unexpected error ({type(exc).__name__}); nothing further was changed; "
                "rerun with MEMVAULT_DEBUG=1 and report it",
                EXIT_FAILED,
            )
        code = rv if isinstance(rv, int) else 0
        if standalone:
            sys.exit(code)
        return code


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(message: str, code: int, as_json: bool = False) -> None:
    if as_json:  # scripts reading stdout get the failure too
        with contextlib.suppress(OSError):
            click.echo(json.dumps({"error": message, "exit_code": code}))
    click.echo(f"memvault: error: {message}", err=True)
    sys.exit(code)


# Click 8.2+ raises this for a group called without a command; 8.1 printed the help.
NO_ARGS_IS_HELP: type[click.exceptions.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", click.exceptions.UsageError
)
if NO_ARGS_IS_HELP is click.exceptions.UsageError:  # pragma: no cover (Click 8.1)
    NO_ARGS_IS_HELP = type("_NeverRaised", (click.exceptions.UsageError,), {})


@click.group(cls=VaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@common
def cli() -> None:
    """Encrypted-at-rest history for OpenAI Agents SDK sessions.

    The vault is a SQLite file whose items are sealed with Fernet under a random
    master key kept in the OS keyring, never beside the file.

    \b
    Example:
      memvault init --ttl 30d
      python -c 'import vault; s = vault.open_session("chat-1")'
      memvault status
    """
    # Checked before any command, so a bad value is a usage error even where no
    # command would have waited for a lock.
    lock_timeout()


def main() -> None:
    cli.main(prog_name="memvault")


# ----------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------
@cli.command()
@click.option(
    "--ttl",
    "ttl",
    callback=duration,
    metavar="DURATION",
    help="How long items stay readable: 90s, 15m, 12h, 30d, 2w, seconds, or never (default 30d).",
)
@common
def init(ttl: Any) -> None:
    """Create the vault file and its random key in the OS keyring.

    Refuses, changing nothing, if a vault (or any file) is already there.

    \b
    Example:
      memvault init --ttl 7d
    """
    seconds = DEFAULT_TTL if ttl is None else ttl[1]
    vault = Vault.init(state().db, ttl=seconds)
    meta = vault.meta()
    data = {
        "path": str(vault.path),
        "vault_id": meta["vault_id"],
        "kid": meta["kid"],
        "ttl": durations.format_duration(seconds),
        "keyring": vault.keystore.name,
    }
    emit(
        data,
        lambda: click.echo(
            f"created vault {data['path']}\n"
            f"  key id  {data['kid']} (key stored in {data['keyring']})\n"
            f"  ttl     {data['ttl']}"
        ),
    )


@cli.command()
@common
def status() -> None:
    """Path, size, permissions, keyring, key state, TTL and item counts.

    \b
    Example:
      memvault status --json
    """
    st = open_vault().status()

    def human() -> None:
        click.echo(f"vault      {st['path']}  ({st['size']} bytes)")
        click.echo(f"folder     mode {st['folder_mode']}")
        for name, f in st["files"].items():
            click.echo(f"  {name:<20} {f['size']:>10} bytes  mode {f['mode']}")
        click.echo(f"keyring    {st['keyring']}")
        key = st["key"] + (f": {st['key_problem']}" if st.get("key_problem") else "")
        click.echo(f"key        {key}")
        click.echo(f"key id     {st['kid']}")
        click.echo(f"ttl        {st['ttl']}")
        counts = f"{plural(st['items'], 'item')} in {plural(st['sessions'], 'session')}"
        if "readable" in st:
            counts += (
                f" ({st['readable']} readable, {st['expired']} expired, "
                f"{st['unreadable']} unreadable)"
            )
        click.echo(f"contents   {counts}")
        click.echo(f"rotated    {st['rotated_at']}")
        if st["scrub_pending"]:
            click.echo("scrub      pending (old bytes may remain until the next command)")
        if st.get("shred_interrupted"):
            click.echo("shred      interrupted: run `memvault shred` again to finish it")

    emit(st, human)


@cli.command()
@common
def sessions() -> None:
    """One row per session: id, items, expired, unreadable, last update.

    \b
    Example:
      memvault sessions
    """
    rows = [s.as_dict() for s in open_vault().sessions()]
    for r in rows:
        r["updated_at"] = iso_utc(r.get("updated_at"))

    def human() -> None:
        if not rows:
            click.echo("no sessions")
            return
        click.echo(f"{'SESSION':<30} {'ITEMS':>6} {'EXPIRED':>8} {'UNREADABLE':>10}  UPDATED")
        for r in rows:
            click.echo(
                f"{r['session_id']:<30} {r['items']:>6} {r['expired']:>8} "
                f"{r['unreadable']:>10}  {r['updated_at'] or '-'}"
            )

    emit(rows, human)


def _item_text(item: Any) -> str:
    if isinstance(item, dict):
        role = item.get("role") or item.get("type") or "item"
        content = item.get("content")
        if isinstance(content, str):
            return f"{role}: {content}"
        if isinstance(content, list):
            parts = [c.get("text", "") for c in content if isinstance(c, dict)]
            if any(parts):
                return f"{role}: {' '.join(p for p in parts if p)}"
        return f"{role}: {json.dumps(item, ensure_ascii=False)}"
    return json.dumps(item, ensure_ascii=False)


@cli.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option(
    "--limit", type=click.IntRange(min=1, max=MAX_COUNT), metavar="N",
    help="Only the newest N items.",
)
@common
def show(session_id: str, limit: int | None) -> None:
    """Print the decrypted items of SESSION, oldest first.

    \b
    Example:
      memvault show carnet-local --limit 10
    """
    vault = open_vault()
    items, expired, unreadable = vault.items(session_id, limit)

    def human() -> None:
        for i, it in enumerate(items, 1):
            click.echo(f"[{i}] {_item_text(it)}")
        if expired:  # otherwise a session of expired items would print nothing at all
            click.echo(
                f"{plural(expired, 'expired item')} hidden by the TTL "
                f"({durations.format_duration(vault.ttl)}); `memvault purge` deletes them"
            )

    data = {"session_id": session_id, "items": items, "expired": expired, "unreadable": unreadable}
    emit(data, human)
    if unreadable:
        raise VaultError(
            f"{plural(unreadable, 'item')} of session {session_id!r} failed authentication "
            "(tampered, corrupt or sealed with another key) and "
            f"{'was' if unreadable == 1 else 'were'} not shown; nothing was changed"
        )


@cli.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option(
    "-n",
    "count",
    type=click.IntRange(min=1, max=MAX_COUNT),
    default=1,
    show_default=True,
    help="How many of the newest items to remove.",
)
@common
def pop(session_id: str, count: int) -> None:
    """Remove the newest N items of SESSION (to undo a turn, pop 2).

    \b
    Example:
      memvault pop carnet-local -n 2
    """
    vault = open_vault()
    popped = vault.pop(session_id, count)
    emit(
        {"session_id": session_id, "popped": popped},
        lambda: click.echo(f"removed {plural(len(popped), 'item')} from {session_id}"),
    )
    check_scrub(vault)


@cli.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--include-unreadable",
    is_flag=True,
    help="Also delete items that fail authentication (refused by default).",
)
@common
def clear(session_id: str, yes: bool, include_unreadable: bool) -> None:
    """Empty SESSION; other sessions in the file are untouched.

    Refuses, deleting nothing, if an item of SESSION fails authentication
    (tampered, corrupt or under another key), unless --include-unreadable.

    \b
    Example:
      memvault clear carnet-local --yes
    """
    vault = open_vault()
    vault.sealer()  # fail on the key before asking anything
    confirm(f"Delete every item of session {session_id!r}?", yes)
    n = vault.clear(session_id, include_unreadable=include_unreadable)
    bad = vault.cleared_unreadable
    emit(
        {
            "session_id": session_id,
            "deleted": n,
            "unreadable_deleted": bad,
            "scrubbed": not vault.scrub_incomplete,
        },
        lambda: click.echo(
            f"cleared {session_id}: {n} item(s) deleted"
            + (f", {bad} of them unreadable" if bad else "")
        ),
    )
    check_scrub(vault)


@cli.command()
@click.argument("value", required=False, callback=duration, metavar="[DURATION]")
@common
def ttl(value: Any) -> None:
    """Print the vault's TTL, or set it (90s, 15m, 12h, 30d, 2w, seconds, never).

    Items older than the TTL are skipped on read and removed by `purge`.

    \b
    Example:
      memvault ttl 7d
    """
    vault = open_vault()
    vault.sealer()  # a revoked or missing key fails here, as every keyed command does
    if value is not None:
        vault.set_ttl(value[1])
    text = durations.format_duration(vault.ttl)
    emit(
        {"ttl": text, "ttl_seconds": vault.ttl},
        lambda: click.echo(f"ttl {text}" + (" (set)" if value is not None else "")),
    )


@cli.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def purge(yes: bool) -> None:
    """Physically delete items past the TTL (only items that authenticate).

    \b
    Example:
      memvault purge --yes
    """
    vault = open_vault()
    vault.sealer()
    if not yes:
        expired = sum(s.expired for s in vault.sessions())
        if expired:  # with nothing to delete there is nothing to ask
            confirm(
                f"Delete the {plural(expired, 'expired item')} of the vault {vault.path} "
                "for good?",
                yes,
            )
    with progress(_count(vault), "purging") as bar:
        report = vault.purge(progress=bar)
    emit(
        {**report.counts, "scrubbed": report.scrubbed},
        lambda: click.echo(
            f"purged {plural(report.counts['deleted'], 'expired item')}; kept "
            f"{plural(report.counts['kept'], 'item')}"
            + (
                f"; {plural(report.counts['unreadable'], 'unreadable item')} left untouched"
                if report.counts["unreadable"]
                else ""
            )
        ),
    )
    check_scrub(vault)


def _count(vault: Vault) -> int:
    return vault.count_items()


@cli.command()
@common
def rotate() -> None:
    """Replace the key: re-encrypt every item, keep timestamps, scrub old bytes.

    Older recovery kits stop working after a rotation: export a new one.

    \b
    Example:
      memvault rotate --json
    """
    vault = open_vault()
    vault.sealer()
    with progress(_count(vault), "rotating") as bar:
        report = vault.rotate(progress=bar)
    c = report.counts
    emit(
        c,
        lambda: click.echo(
            f"rotated {plural(c['items'], 'item')} in {plural(c['sessions'], 'session')} "
            f"in {c['seconds']}s\n"
            f"  key id  {c['old_kid']} -> {c['new_kid']}\n"
            f"  expired {c['expired']}, unreadable {c['unreadable']}\n"
            "  older recovery kits no longer match: run `memvault key export` again"
        ),
    )
    check_scrub(vault)



@cli.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@common
def revoke(yes: bool) -> None:
    """Destroy the key. The file stays, unreadable for ever (cryptographic erase).

    \b
    Example:
      memvault revoke --yes && memvault shred --yes
    """
    vault = open_vault()
    confirm(
        f"Destroy the key of the vault {vault.path}? Its history can never be read again",
        yes,
    )
    r = vault.revoke()

    def human() -> None:
        if r["already_revoked"]:
            finished = "; removed the key a cut-off revoke had left" if r["key_destroyed"] else ""
            click.echo(
                f"vault {r['vault_id']} was already revoked (key {r['kid']}){finished}; "
                "`memvault shred` removes the file"
            )
            return
        click.echo(
            f"revoked key {r['kid']} of vault {r['vault_id']}; the file stays, unreadable; "
            "`memvault shred` removes it; recovery kits are useless now"
        )

    emit(r, human)


@cli.command("shred")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--receipt",
    metavar="FILE",
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

    --receipt FILE must name a new file in an existing, writable folder: an
    existing file or link is never replaced. It is checked before anything is
    destroyed (exit 2 if unusable).

    \b
    Example:
      memvault shred --yes --receipt shred-receipt.json
    """
    from .files import check_new_file, write_private
    from .store import _regular_files, shred_target

    target = shred_target(state().db)  # no vault, nothing asked (exit 3)
    path = target["path"]
    if receipt is not None:
        check_new_file(receipt, "receipt")
    named = f" {target['vault_id']}" if target["vault_id"] else ""
    confirm(f"Destroy the vault{named} at {path}, its key and its files?", yes)
    size = sum(n for _, n in _regular_files(path))
    with _bar(size, "overwriting") as bar:

        def resize(total: int) -> None:
            bar.length = max(total, 1)  # the checkpoint may have emptied the WAL

        r = shred(path, progress=bar.update if bar else None, on_total=resize if bar else None)
    failure = None
    if receipt is not None:
        try:
            write_private(receipt, (json.dumps(r, indent=2, sort_keys=True) + "\n").encode())
        except OSError as exc:
            failure = (
                f"the vault was shredded, but the receipt {receipt} could not be written "
                f"({exc.strerror}); keep the summary printed above instead"
            )
    emit(r, lambda: click.echo(_shred_summary(r)))
    if failure:
        raise OperationFailed(failure)


def _shred_summary(r: dict[str, Any]) -> str:
    def one(f: dict[str, Any]) -> str:
        if f.get("kind", "file") == "file":
            return f"{f['name']} ({f['size']} bytes)"
        return f"{f['name']} ({f['kind']} removed, not followed)"

    if r.get("items") is None:
        counts = "damaged file, contents not counted"
    else:
        counts = f"{r['items']} item(s) in {r['sessions']} session(s)"
    key = "destroyed" if r.get("key_destroyed") else "already gone"
    if r.get("key_problem"):
        key = f"not destroyed: {r['key_problem']}"
    return (
        f"shredded {r['path']}: {counts}; key {key}; files "
        + ", ".join(one(f) for f in r["files"])
    )


@cli.command()
@common
def log() -> None:
    """The audit trail: key and lifecycle events with counts, never content.

    \b
    Example:
      memvault log --json
    """
    rows = open_vault().audit_log()
    for r in rows:
        if r["event"] == "ttl":  # stored as seconds; shown as everywhere else (30d, never)
            for k in ("old", "new"):
                r[k] = _ttl_text(r.get(k))

    def human() -> None:
        for r in rows:
            extra = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("at", "event", "kid"))
            click.echo(f"{r['at']}  {r['event']:<10} {r['kid'] or '-':<22} {extra}")

    emit(rows, human)


def _ttl_text(value: Any) -> Any:
    if value is None or value == "never":
        return value
    try:
        return durations.format_duration(int(value))
    except (TypeError, ValueError):
        return value  # a value an older version wrote: shown as it is


def refuse_option(option: str, command: str, why: str) -> None:
    """A global option the command cannot honour: a usage error, not silence."""
    raise click.UsageError(f"{option} does not apply to `{command}`: {why}")


@cli.command()
@click.option("--keep", is_flag=True, help="Keep the throwaway vault folder for inspection.")
@common
def demo(keep: bool) -> None:
    """Run the guide's four checks in a throwaway vault, each step its own process.

    Uses the real model when OPENAI_API_KEY is set, else an offline stand-in
    that can only answer from the history it is given. --db and --json are
    refused (exit 2): the demo makes its own vault and prints a narrative.

    \b
    Example:
      memvault demo
    """
    if state().db is not None:
        refuse_option("--db", "demo", "it always works in a throwaway vault of its own")
    if state().json:
        refuse_option("--json", "demo", "it prints a narrative, not a document")
    from .demo import run_demo

    ok = run_demo(keep=keep, echo=click.echo)
    if not ok:
        raise VaultError("the demo found a failing check (see above)")


# ----------------------------------------------------------------------------
# Living with the vault: import, the recovery kit, chat. Logic in vault.importer,
# vault.kit and vault.chat; modules imported inside each command.
# ----------------------------------------------------------------------------
@cli.command("import")
@click.argument("plain_db", metavar="PLAIN_DB")
@click.option("--session", "session_id", metavar="ID", type=SESSION,
              help="Import only this session.")
@click.option(
    "--sessions-table",
    metavar="NAME",
    help="The source's sessions table, if it is not found by its shape.",
)
@click.option(
    "--messages-table",
    metavar="NAME",
    help="The source's messages table, if it is not found by its shape.",
)
@click.option(
    "--shred-source",
    is_flag=True,
    help="After a verified import, destroy PLAIN_DB: rows, then the file, -wal, -shm, -journal.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (--shred-source).")
@common
def import_cmd(
    plain_db: str,
    session_id: str | None,
    sessions_table: str | None,
    messages_table: str | None,
    shred_source: bool,
    yes: bool,
) -> None:
    """Encrypt a plaintext SQLiteSession file (such as carnet.db) into the vault.

    Every session (or only --session ID) is sealed with the vault's key and
    written in one transaction per session, in the original order, then read
    back and compared before it counts as imported. Custom table names are
    recognised by their shape. The TTL of imported items counts from the import.

    Refuses, importing nothing: a file that is not a plaintext SQLiteSession
    file (exit 1), a session id already in the vault (exit 1), a missing file
    (exit 2), and with --shred-source a source still open elsewhere (exit 5)
    or holding tables or sessions the import would not carry over (exit 1).

    \b
    Example:
      memvault import carnet.db
      memvault import app.db --session carnet-local --sessions-table my_sessions \\
          --messages-table my_messages
      memvault import carnet.db --shred-source --yes
    """
    from .importer import Importer

    vault = open_vault()
    vault.sealer()  # fail on the key before reading anything
    with Importer(vault, plain_db, session_id, sessions_table, messages_table,
                  shred_source) as importer:
        plan = importer.plan
        if shred_source:
            confirm(
                f"Import {plural(len(plan.sessions), 'session')} "
                f"({plural(plan.total_items, 'item')}) into the vault {vault.path}, then "
                f"destroy {plan.source} and its side files?",
                yes,
            )
        with progress(plan.total_items, "importing") as bar:
            r = importer.run(progress=bar)

    def human() -> None:
        click.echo(
            f"imported {plural(r['items'], 'item')} in "
            f"{plural(len(r['sessions']), 'session')} from "
            f"{r['source']} (tables {r['tables']['sessions']}/{r['tables']['messages']}), "
            f"sealed with key {r['kid']}; counts and contents verified"
        )
        for s in r["sessions"]:
            click.echo(f"  {s['session_id']:<30} {plural(s['items'], 'item'):>11}")
        shredded = r["source_shredded"]
        if shredded:
            click.echo(
                f"destroyed the source: {plural(shredded['rows'], 'row')} deleted, then "
                + ", ".join(f"{f['name']} ({f['size']} bytes)" for f in shredded["files"])
                + " overwritten and removed"
            )

    emit(r, human)


@cli.group("key")
@common
def key_group() -> None:
    """The recovery kit: the master key wrapped under a passphrase, in a file.

    Keep the kit apart from the vault file. A rotation or a revocation makes
    older kits useless: export a new kit after each rotation.

    \b
    Example:
      memvault key export ~/memvault-kit.json
      memvault key import ~/memvault-kit.json
    """


def _read_passphrase(twice: bool) -> str:
    """Asked (hidden, twice for a new kit) on a terminal; else one line of stdin."""
    if sys.stdin.isatty():
        try:
            return str(
                click.prompt(
                    "Recovery kit passphrase",
                    hide_input=True,
                    confirmation_prompt="Repeat the passphrase" if twice else False,
                    err=True,
                )
            )
        except click.exceptions.Abort as exc:
            if isinstance(exc.__context__, KeyboardInterrupt):
                raise Interrupted(
                    "interrupted at the passphrase prompt; nothing was changed"
                ) from None
            raise
    return sys.stdin.readline().rstrip("\r\n")


@key_group.command("export")
@click.argument("file", metavar="FILE")
@click.option("--force", is_flag=True, help="Replace FILE if it exists.")
@common
def key_export(file: str, force: bool) -> None:
    """Write the master key, wrapped under a passphrase, to FILE (mode 0600).

    scrypt derives a key from the passphrase; AES-256-GCM seals the master key
    and authenticates the kit's header (vault id, key id, parameters). The
    passphrase is asked twice on a terminal, else read as one line from stdin.
    The key itself is never printed. Refuses an existing FILE unless --force.

    \b
    Example:
      memvault key export ~/memvault-kit.json
      printf '%s\\n' "$PASSPHRASE" | memvault key export kit.json
    """
    from .kit import SHORT_PASSPHRASE, check_passphrase, export_kit

    vault = open_vault()
    vault.sealer()  # a working key, before asking anything
    passphrase = _read_passphrase(twice=True)
    check_passphrase(passphrase)
    if len(passphrase) < SHORT_PASSPHRASE:
        click.echo(
            f"warning: the passphrase is shorter than {SHORT_PASSPHRASE} characters; anyone "
            "holding the kit file can try to guess it offline",
            err=True,
        )
    r = export_kit(vault, file, passphrase, force=force)
    emit(
        r,
        lambda: click.echo(
            f"wrote recovery kit {r['path']} (mode 0600) for vault {r['vault_id']}, key "
            f"{r['kid']}\n  keep it away from the vault file; a rotation makes it useless"
        ),
    )


@key_group.command("import")
@click.argument("file", metavar="FILE")
@click.option("--yes", is_flag=True, help="Replace a keyring key that does not open the vault.")
@common
def key_import(file: str, yes: bool) -> None:
    """Restore the master key from a recovery kit into the OS keyring.

    The kit must come from this vault and its current key: a kit from another
    vault, or from before a rotation, is refused naming both ids. A keyring key
    that already opens the vault is left alone; one that does not is moved
    aside (kept as memvault/<vault_id>.replaced.<kid>, since it may open another
    copy of the vault) after a question (or --yes). The passphrase is asked on a terminal, else
    read as one line from stdin. The key itself is never printed.

    \b
    Exit codes:
      1  the kit does not open: wrong passphrase, altered kit, or not a kit
      3  no vault at that path
      4  the kit's key does not fit this vault (another vault, a rotation since,
         revoked), or the keyring is unusable

    \b
    Example (new laptop, after copying the vault file and the kit):
      memvault --db ~/history.db key import ~/memvault-kit.json
    """
    from .kit import import_kit

    vault = open_vault()

    def ask_replace(old_kid: str) -> None:
        confirm(
            f"The keyring holds key {old_kid} for this vault id, which does not open "
            f"{vault.path}; it may be the key of another copy of the vault (a newer one, rotated "
            "since). Keep it aside and put the kit's key in its place?",
            yes,
        )

    r = import_kit(vault, file, lambda: _read_passphrase(twice=False), ask_replace)

    def human() -> None:
        if r["restored"]:
            extra = f" (replaced key {r['replaced_kid']})" if r["replaced_kid"] else ""
            if r.get("kept_aside_as"):
                extra += f"; the replaced key is kept as memvault/{r['kept_aside_as']}"
            click.echo(
                f"restored key {r['kid']} of vault {r['vault_id']} into {r['keyring']}{extra}; "
                "the vault opens again"
            )
        else:
            click.echo(
                f"kit verified: the keyring already holds key {r['kid']} of vault "
                f"{r['vault_id']}; nothing was changed"
            )

    emit(r, human)


@cli.command()
@click.argument("session_id", metavar="SESSION", type=SESSION)
@click.option("--model", "model", metavar="M", help="Model name (default: the SDK's default).")
@common
def chat(session_id: str, model: str | None) -> int:
    """Talk to an agent whose history lives, encrypted, in SESSION of the vault.

    Resumes where the last run stopped and streams the replies. At the prompt:
    /undo removes the last turn (the replies and your message), /clear empties
    the session, /exit (or Ctrl-D) leaves. Needs OPENAI_API_KEY (exit 4
    without it). SDK tracing is off: the conversation goes only to the model.
    --json is refused (exit 2): a conversation is not a document.

    \b
    Example:
      export OPENAI_API_KEY=sk-...
      memvault chat carnet-local --model gpt-4.1-mini
    """
    if state().json:
        refuse_option("--json", "chat", "a conversation is not one document")
    from .chat import run_chat

    return run_chat(state().db, session_id, model)
