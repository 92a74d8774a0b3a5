"""The `memvault` command: parse arguments, call the library, print.

Logic lives in `vault.store`; the command modules only format. `main` is the
single place that maps a `VaultError` (or a Click usage error) to one line on
stderr and its exit code. This module holds the group, that mapping, the shared
options and the output helpers; the commands live in `cli_history` (the history
and its TTL), `cli_admin` (purge, rotate, revoke, shred), `cli_keys` (the
recovery kit), `cli_agent` (import, demo, chat) and `cli_shell` (completion),
each registering itself on `cli` when imported at the end of this module. The
Agents SDK is imported only by `demo` and `chat`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from . import durations
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, Interrupted, VaultBusy, VaultError
from .store import Progress, Vault, lock_timeout
from .textsafe import escape_line

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

    from .pg import PgVault

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
        from .cli_shell import complete_session_ids

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
        from . import __version__  # the installed metadata, read only when asked

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


def open_vault() -> Vault:
    return Vault.open(state().db)


def postgres_url() -> str | None:
    """The PostgreSQL URL that --db or $MEMVAULT_DB names, or None for a file."""
    from .paths import postgres_url as named_url

    return named_url(state().db)


def refuse_vault_target(path: str | None, why: str) -> None:
    """Before the vault is opened (exit 2): a FILE argument that is the vault file or one
    of its side files. Opening could fail first, on the very link that names it."""
    if not path or path == "-" or postgres_url() is not None:
        return
    from .paths import resolve_db_path
    from .targets import refuse_vault_file

    refuse_vault_file(path, resolve_db_path(state().db), why)


def open_any() -> Vault | PgVault:
    """The vault, in a file or (for the commands that support it) in PostgreSQL."""
    url = postgres_url()
    if url is None:
        return Vault.open(state().db)
    from .pg import PgVault

    return PgVault.open(url)


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
    # Escaped first: a newline in a path or a session id shows as \x0a, not as a space.
    return " ".join(escape_line(str(text)).split())


def _fail(message: str, code: int, as_json: bool = False) -> None:
    if as_json:  # scripts reading stdout get the failure too
        with contextlib.suppress(OSError):
            click.echo(json.dumps({"error": message, "exit_code": code}))
    click.echo(f"memvault: error: {escape_line(message)}", err=True)
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

    The vault is a SQLite file, or a PostgreSQL database (--db postgresql://...),
    whose items are sealed with Fernet under a random master key kept in the OS
    keyring, never beside the data.

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


# The commands register themselves on `cli`; imported last, since they import it from here.
from . import (  # noqa: E402, F401
    cli_admin,
    cli_agent,
    cli_care,
    cli_data,
    cli_history,
    cli_kept,  # noqa: E402, F401  (after cli_keys: it adds to the `key` group)
    cli_keys,
    cli_shell,
)
