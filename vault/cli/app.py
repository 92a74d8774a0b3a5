"""The `memvault` group and its `main`: the one place a failure becomes one line.

`VaultGroup.main` maps a `VaultError` (or a Click usage error, a Ctrl-C, a bug) to
one line on stderr and its documented exit code. The commands are defined in the
modules of this package, none of which imports this one: each lists what it adds
in `COMMANDS`, and `COMMAND_MODULES` below is the one place they are registered.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import click

from vault.cli import admin, agent, care, data, history, keys, shell, status
from vault.cli.common import State, common
from vault.engines.sqlite.vault import lock_timeout
from vault.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, VaultError
from vault.keys import keyring_timeout
from vault.textsafe import escape_line


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
    # command would have waited for a lock or reached the keyring.
    lock_timeout()
    keyring_timeout()


def main() -> None:
    cli.main(prog_name="memvault")


# The one registration point: each command module's `COMMANDS`, in help order.
COMMAND_MODULES = (status, history, data, care, admin, keys, agent, shell)
for _module in COMMAND_MODULES:
    for _command in _module.COMMANDS:
        cli.add_command(_command)
