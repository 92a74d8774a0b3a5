"""`memvault key`: the recovery kit (export and import). Logic in vault.kitops,
imported inside each command.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable

import click

from vault import files
from vault.cli.common import PATH, F, common, confirm, emit, open_any, refuse_vault_target, say
from vault.cli.kept import key_forget, key_list, key_move, key_rewrap
from vault.errors import BadInput, Interrupted


@click.group("key")
@common
def key_group() -> None:
    """The recovery kit: the master key wrapped under a passphrase, in a file.

    Keep the kit apart from the vault file. A rotation or a revocation makes
    older kits useless: export a new kit after each rotation.

    The passphrase is asked on a terminal (twice for a new kit). Scripts give
    --passphrase-file FILE or --passphrase-stdin instead; with no terminal and
    neither option, the command stops (exit 2) rather than read stdin unasked.

    \b
    Example:
      memvault key export ~/memvault-kit.json
      memvault key import ~/memvault-kit.json
      memvault key export --passphrase-file pass.txt kit.json
    """


# A passphrase is one line; a file far larger than that is the wrong file.
MAX_PASSPHRASE_BYTES = 4096
# Pipes are waited for, never for ever: a FIFO's writer may start a moment after us,
# and a writer may need a while (gpg asking for its own passphrase).
PIPE_WRITER_SECONDS = 10.0
PIPE_SILENCE_SECONDS = 120.0
PIPE_POLL_SECONDS = 0.2


def passphrase_options(fn: F) -> F:
    """--passphrase-file and --passphrase-stdin, for scripts (no terminal to ask on)."""
    fn = click.option(
        "--passphrase-stdin",
        is_flag=True,
        help="Read the passphrase from stdin (all of it, one trailing newline removed).",
    )(fn)
    fn = click.option(
        "--passphrase-file",
        metavar="FILE",
        type=PATH,
        help="Read the passphrase from FILE (a file or a pipe such as <(pass show x); "
        "one trailing newline removed).",
    )(fn)
    return fn


def passphrase_source(passphrase_file: str | None, passphrase_stdin: bool) -> Callable[[bool], str]:
    """Check the options at once (usage errors before any work); read the passphrase later.

    Without an option the passphrase is asked on the terminal; with no terminal that
    is a usage error naming the two options, never a silent read of stdin.
    """
    ctx = click.get_current_context()
    if passphrase_file is not None and passphrase_stdin:
        raise click.UsageError(
            "--passphrase-file and --passphrase-stdin exclude each other; give one", ctx
        )
    if passphrase_file is not None:
        return lambda _twice: read_passphrase_file(passphrase_file)
    if passphrase_stdin:
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError(
                "--passphrase-stdin needs the passphrase piped in, not a terminal; leave "
                "the option out to be asked for it (hidden)",
                ctx,
            )
        return lambda _twice: read_passphrase_stdin()
    if sys.stdin is None or not sys.stdin.isatty():
        raise click.UsageError(
            "no terminal to ask the passphrase on; give --passphrase-file FILE or "
            "--passphrase-stdin",
            ctx,
        )
    return prompt_passphrase


def prompt_passphrase(twice: bool) -> str:
    """Asked on the terminal, hidden; twice for a new kit."""
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
            raise Interrupted("interrupted at the passphrase prompt; nothing was changed") from None
        raise


def read_passphrase_stdin() -> str:
    """All of stdin (until the writer closes it), as `docker login --password-stdin` reads."""
    data = sys.stdin.buffer.read(MAX_PASSPHRASE_BYTES + 1)
    return one_passphrase(data, "stdin")


def read_passphrase_file(path: str) -> str:
    """The passphrase in a regular file or a pipe (a FIFO, or `<(pass show x)`'s /dev/fd/N).

    Never blocks for ever: the file is opened non-blocking, a FIFO nobody opens for
    writing within PIPE_WRITER_SECONDS is refused, and so is a pipe whose writer
    stays silent for PIPE_SILENCE_SECONDS. Devices and sockets are refused without
    being opened. Warns when others may read the file.
    """
    where = f"the passphrase file {files.shown(path)}"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise BadInput(f"{where} does not exist; give the file that holds the passphrase") from None
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot read {where} ({_why(exc)}); nothing was changed") from None
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise BadInput(
            f"{path} is a {files.kind(mode)}; give a file or a pipe holding the passphrase"
        )
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise BadInput(f"cannot read {where} ({_why(exc)}); nothing was changed") from None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):  # swapped meanwhile
            what = files.kind(st.st_mode)
            raise BadInput(f"{path} is a {what}; give a file or a pipe holding the passphrase")
        if os.name == "posix" and st.st_mode & 0o044:
            say(
                f"warning: {where} is readable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}",
                err=True,
            )
        data = _read_pipe(fd, where) if stat.S_ISFIFO(st.st_mode) else _read_some(fd)
    except OSError as exc:
        raise BadInput(f"cannot read {where} ({_why(exc)}); nothing was changed") from None
    finally:
        os.close(fd)
    if not data and stat.S_ISFIFO(st.st_mode):
        raise BadInput(
            f"nothing came through the pipe {path} (no writer within "
            f"{PIPE_WRITER_SECONDS:g} s, or it wrote nothing); check the command that writes "
            "the passphrase"
        )
    return one_passphrase(data, where)


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__


def _read_some(fd: int) -> bytes:
    out = b""
    while len(out) <= MAX_PASSPHRASE_BYTES:
        block = os.read(fd, MAX_PASSPHRASE_BYTES + 1 - len(out))
        if not block:
            break
        out += block
    return out


def _read_pipe(fd: int, where: str) -> bytes:
    """Read a non-blocking pipe until every writer has closed it, within bounds.

    A named FIFO may be opened before its writer (`printf ... > fifo &` has not run
    yet): up to PIPE_WRITER_SECONDS are allowed for one to appear. A writer that is
    there but silent (gpg asking for its own passphrase) gets PIPE_SILENCE_SECONDS
    since its last byte. Neither wait is endless.
    """
    import select
    import time

    out = b""
    started = last = time.monotonic()
    while len(out) <= MAX_PASSPHRASE_BYTES:
        ready, _, _ = select.select([fd], [], [], PIPE_POLL_SECONDS)
        try:
            block = os.read(fd, MAX_PASSPHRASE_BYTES + 1 - len(out))
        except BlockingIOError:  # a writer is there, nothing written yet
            if time.monotonic() - last > PIPE_SILENCE_SECONDS:
                raise BadInput(
                    f"nothing came through {where} for {PIPE_SILENCE_SECONDS:g} s; check the "
                    "command that writes the passphrase"
                ) from None
            continue
        if block:
            out += block
            last = time.monotonic()
            continue
        # End of file: no writer holds the pipe. Final once something was read or a
        # writer came and went (select saw it); before that, maybe no writer yet.
        if out or ready or time.monotonic() - started > PIPE_WRITER_SECONDS:
            break
    return out


def one_passphrase(data: bytes, where: str) -> str:
    """The passphrase in `data`: UTF-8, one line, exactly one trailing newline removed.

    Nothing else is stripped: spaces are part of a passphrase. A second line is
    refused rather than kept, since no prompt could ever type it back.
    """
    if len(data) > MAX_PASSPHRASE_BYTES:
        raise BadInput(
            f"{where} holds more than {MAX_PASSPHRASE_BYTES} bytes; it is not a passphrase "
            "(the wrong file?)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{where} is not UTF-8 text; put the passphrase in it as text") from None
    for newline in ("\r\n", "\n"):
        if text.endswith(newline):
            text = text[: -len(newline)]
            break
    if "\n" in text or "\r" in text:
        raise BadInput(f"{where} holds more than one line; put the passphrase alone on one line")
    if text == "":
        raise BadInput(f"the passphrase is empty (from {where}); a recovery kit needs a passphrase")
    return text


@key_group.command("export")
@click.argument("file", metavar="FILE", type=PATH)
@click.option("--force", is_flag=True, help="Replace FILE if it is a recovery kit of this vault.")
@passphrase_options
@common
def key_export(file: str, force: bool, passphrase_file: str | None, passphrase_stdin: bool) -> None:
    """Write the master key, wrapped under a passphrase, to FILE (mode 0600).

    The kit also holds every older key version the vault keeps for its backups
    (and a rotation's pending key), so one kit opens the vault and its backups.

    scrypt derives a key from the passphrase; AES-256-GCM seals the master key
    and authenticates the kit's header (vault id, key id, parameters). The
    passphrase is asked twice on a terminal; scripts give --passphrase-file or
    --passphrase-stdin (one line; one trailing newline is removed, nothing else).
    A pipe is a fine FILE: `<(pass show memvault)` never leaves the passphrase on
    disk. The key and the passphrase are never printed. Refuses an existing FILE
    unless --force, which replaces only a recovery kit of this same vault (its
    format and vault id say so), never another file. FILE is never the vault
    or one of its -wal, -shm, -journal files, nor a link to them (exit 2, with
    --force too). On a PostgreSQL vault, refuses (exit 5) while a rotation is
    unfinished: the kit's one key would not open the rows not yet moved.

    \b
    Example:
      memvault key export ~/memvault-kit.json
      memvault key export --passphrase-file pass.txt kit.json
      printf %s "$PASS" | memvault key export --passphrase-stdin kit.json
    """
    from vault.kit import SHORT_PASSPHRASE, check_passphrase
    from vault.kitfile import check_kit_target
    from vault.kitops import export_kit
    from vault.targets import over_vault

    ask = passphrase_source(passphrase_file, passphrase_stdin)
    refuse_vault_target(file, over_vault("recovery kit"))
    vault = open_any()
    vault.sealer()  # a working key, before asking anything
    check_kit_target(vault, file, force)  # and a usable FILE
    passphrase = ask(True)
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
        lambda: say(
            f"wrote recovery kit {r['path']} (mode 0600) for vault {r['vault_id']}, key {r['kid']}",
            "  keep it away from the vault file; a rotation makes it useless",
        ),
    )


@key_group.command("import")
@click.argument("file", metavar="FILE", type=PATH)
@click.option("--yes", is_flag=True, help="Replace a keyring key that does not open the vault.")
@passphrase_options
@common
def key_import(file: str, yes: bool, passphrase_file: str | None, passphrase_stdin: bool) -> None:
    """Restore the master key from a recovery kit into the OS keyring.

    The kit must come from this vault and hold the key the file uses: a kit from
    another vault, or from before a rotation, is refused naming the ids. Of the
    kit's keys, each one this file needs (its own key, and the versions its
    journal keeps) is stored, each as its own entry (memvault/<vault_id>/<kid>): no other entry is
    touched, so a live vault and a restored backup copy of it both keep working.
    An entry of that key that holds something else (damaged) is replaced after a
    question (or --yes). The passphrase is asked on a terminal; scripts give
    --passphrase-file or --passphrase-stdin (then stdin holds only the
    passphrase: add --yes for the question). The key and the passphrase are
    never printed.

    \b
    Exit codes:
      1  the kit does not open: wrong passphrase, altered kit, or not a kit
      2  usage: no terminal and no --passphrase-file/--passphrase-stdin, an
         unreadable or empty passphrase file
      3  no vault at that path
      4  the kit's key does not fit this vault (another vault, a rotation since,
         revoked), or the keyring is unusable

    \b
    Example (new laptop, after copying the vault file and the kit):
      memvault --db ~/history.db key import ~/memvault-kit.json
      printf %s "$PASS" | memvault key import --passphrase-stdin kit.json
    """
    from vault.kitops import import_kit

    ask = passphrase_source(passphrase_file, passphrase_stdin)
    vault = open_any()

    def ask_replace(old_kid: str) -> None:
        confirm(
            f"The keyring entry for this key of {vault.path} holds something else "
            f"({old_kid}); replace it with the kit's key?",
            yes,
        )

    r = import_kit(vault, file, lambda: ask(False), ask_replace)
    r.update(vault.settle_keyring())

    def human() -> None:
        if r.get("destroyed_here"):
            say(
                f"destroyed this keyring's entries of retired keys {', '.join(r['destroyed_here'])}"
            )
        if r.get("kept_until_rotation_ends"):
            say(
                f"kept key {', '.join(r['kept_until_rotation_ends'])} in this keyring: a "
                "rotation still moves rows from it; run this import again once it has finished "
                "(`memvault status` shows no rotation) to delete it here"
            )
        if r["restored"]:
            extra = f" (replaced key {r['replaced_kid']})" if r["replaced_kid"] else ""
            say(
                f"restored key {', '.join(r['stored_kids'])} of vault {r['vault_id']} into "
                f"{r['keyring']}{extra}; the vault opens again"
            )
        else:
            say(
                f"kit verified: the keyring already holds key {r['kid']} of vault "
                f"{r['vault_id']}; nothing was changed"
            )

    emit(r, human)


key_group.add_command(key_list)
key_group.add_command(key_forget)
key_group.add_command(key_rewrap)
key_group.add_command(key_move)

COMMANDS = (key_group,)
