"""`memvault completion`: the shell completion script, and the session ids it offers.

The script is Click's own (`_MEMVAULT_COMPLETE=bash_source memvault` prints the
same); at each TAB the shell runs `memvault` with `_MEMVAULT_COMPLETE` set, and
Click asks each parameter type for candidates. Session ids are plaintext in the
vault file, so completing them needs no key: this module reads them with a
read-only SQLite connection and never touches the keyring, never imports the
Agents SDK, never creates a file, and answers nothing at all on any error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from vault.cli.common import common, hide_options, refuse_option, state

if TYPE_CHECKING:
    pass

SHELLS = ("bash", "zsh", "fish")
# Enough for any menu a shell shows; a vault with a million sessions still answers fast.
MAX_CANDIDATES = 1000
# Completion runs at each TAB: it never waits long for a lock.
COMPLETION_TIMEOUT = 1.0


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS), metavar="{bash|zsh|fish}")
@common
def completion(shell: str) -> None:
    """Print the shell completion script for bash, zsh or fish.

    Completes commands, options, file paths and the session ids of the vault
    (read from the file, which keeps them in clear: no key is needed and the
    keyring is never asked). The vault is the one --db or $MEMVAULT_DB names
    on the line being completed, else the default vault.

    \b
    Example:
      memvault completion bash > ~/.memvault-complete.bash
      echo '. ~/.memvault-complete.bash' >> ~/.bashrc
      memvault completion zsh > ~/.memvault-complete.zsh
      echo '. ~/.memvault-complete.zsh' >> ~/.zshrc
      memvault completion fish > ~/.config/fish/completions/memvault.fish
    """
    if state().json:
        refuse_option("--json", "completion", "it prints a shell script, not a document")
    if state().db is not None:
        refuse_option(
            "--db", "completion", "the script reads --db or $MEMVAULT_DB from each completed line"
        )
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root()
    prog_name = root.info_name or "memvault"
    # The variable Click's own machinery answers to (`_MEMVAULT_COMPLETE`).
    complete_var = f"_{prog_name.replace('-', '_').replace('.', '_')}_COMPLETE".upper()
    comp_cls = get_completion_class(shell)
    if comp_cls is None:  # pragma: no cover (Click ships all three)
        raise click.UsageError(f"no completion support for {shell}")
    # Bytes, as Click writes it: a text stdout on Windows would turn LF into CRLF.
    click.echo(comp_cls(root.command, {}, prog_name, complete_var).source().encode(), nl=False)


hide_options(completion, "db", "as_json")  # refused above: its --help does not offer them


COMMANDS = (completion,)
