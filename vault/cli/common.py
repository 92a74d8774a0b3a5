"""What every command shares: the options that work before or after the command
name (--db, --json, --version, --help), the parameter types, opening the vault,
and the output helpers (emit, say, confirm, progress). Imports no command module."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from vault import durations
from vault.errors import Interrupted, VaultBusy
from vault.files import Progress
from vault.textsafe import escape_line

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

    from vault.engine import AnyVault

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


class Count(click.IntRange):
    """A count from 1 to MAX_COUNT. `--help` shows `x>=1`: the 64-bit ceiling is named
    only to someone who passes it."""

    name = "count"

    def __init__(self) -> None:
        super().__init__(min=1, max=MAX_COUNT)

    def _describe_range(self) -> str:
        return "x>=1"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        n = click.INT.convert(value, param, ctx)
        if n > MAX_COUNT:
            self.fail(f"{n} is not in the range 1<=x<={MAX_COUNT} (the largest count)", param, ctx)
        return super().convert(n, param, ctx)


COUNT = Count()


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

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        # Session ids are plaintext in the file: no key, no keyring, no agents import.
        from vault.cli.complete import complete_session_ids

        st = ctx.find_object(State)
        return complete_session_ids(st.db if st else None, incomplete)


SESSION = SessionId()


class PathArg(click.Path):
    """A file path: click.Path's shell completion, none of its checks.

    The library checks every path itself, with its own messages and exit codes
    (a FIFO, a link, a non-UTF-8 name...); click.Path's own checks would answer
    first, differently, and crash on a path `os.stat` cannot take.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value


PATH = PathArg()


def _remember_db(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(State).db = value


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(State).json = True


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from vault import __version__

        click.echo(f"memvault, version {__version__}")
        ctx.exit()


def common(fn: F) -> F:
    fn = click.option(
        "--version",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_show_version,
        help="Show the version and exit.",
    )(fn)
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
        type=PATH,
        expose_value=False,
        callback=_remember_db,
        help=(
            "The vault: a file, or a postgresql:// URL (default: $MEMVAULT_DB, else "
            "history.db in the platformdirs data folder)."
        ),
    )(fn)
    return fn


def state() -> State:
    return click.get_current_context().ensure_object(State)


def postgres_url() -> str | None:
    """The PostgreSQL URL that --db or $MEMVAULT_DB names, or None for a file."""
    from vault.paths import postgres_url as named_url

    return named_url(state().db)


def refuse_vault_target(path: str | None, why: str) -> None:
    """Before the vault is opened (exit 2): a FILE argument that is the vault file or one
    of its side files. Opening could fail first, on the very link that names it."""
    if not path or path == "-" or postgres_url() is not None:
        return
    from vault.paths import resolve_db_path
    from vault.targets import refuse_vault_file

    refuse_vault_file(path, resolve_db_path(state().db), why)


def open_any() -> AnyVault:
    """The vault --db names, a file or a PostgreSQL URL: one type whichever it is."""
    from vault.engines.registry import open_vault

    vault = open_vault(state().db)
    # As the command ends, whatever its outcome: a command that opened the key records
    # the vault's state outside the file (vault.engines.sqlite.anchoring).
    click.get_current_context().call_on_close(vault.record_anchor)
    return vault


def emit(data: Any, human: Callable[[], None]) -> None:
    """JSON on stdout with --json, else the human rendering."""
    if state().json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        state().emitted = True
    else:
        human()


def say(*lines: str, err: bool = False) -> None:
    """Print human lines, each escaped as one line (vault.textsafe): a value in them
    can neither start a new line nor reach the terminal as a control sequence."""
    click.echo("\n".join(escape_line(line) for line in lines), err=err)


def confirm(question: str, yes: bool) -> None:
    """Ask before a destructive step. "n" is exit 1; Ctrl-C is exit 130 (Interrupted)."""
    if yes:
        return
    try:
        answer = click.confirm(escape_line(question), err=True)
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
    with progress_bar(length, label) as bar:
        yield bar.update if bar else None


@contextmanager
def progress_bar(length: int, label: str) -> Iterator[Any]:
    if not sys.stderr.isatty() or length <= 0:
        yield None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
        yield bar


def check_scrub(scrubbed: bool) -> None:
    """After the result is printed: exit 5 if old bytes may still be in the files.

    The change itself is committed; the next memvault command finishes the scrub.
    """
    if not scrubbed:
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


def hide_options(command: click.Command, *names: str) -> None:
    """Leave the shared options a command refuses out of its --help."""
    for param in command.params:
        if param.name in names and isinstance(param, click.Option):
            param.hidden = True


def refuse_option(option: str, command: str, why: str) -> None:
    """A global option the command cannot honour: a usage error, not silence."""
    raise click.UsageError(f"{option} does not apply to `{command}`: {why}")


# ----------------------------------------------------------------------------
# The group and the error mapping
# ----------------------------------------------------------------------------
