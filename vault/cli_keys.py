"""`memvault key`: the recovery kit (export and import). Logic in vault.kit,
imported inside each command.
"""

from __future__ import annotations

import sys

import click

from .cli import cli, common, confirm, emit, open_vault
from .errors import Interrupted


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
    is stored as its own entry (memvault/<vault_id>/<kid>): no other entry is
    touched, so a live vault and a restored backup copy of it both keep working.
    An entry of that key that holds something else (damaged) is replaced after a
    question (or --yes). The passphrase is asked on a terminal, else
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
            f"The keyring entry for this key of {vault.path} holds something else "
            f"({old_kid}); replace it with the kit's key?",
            yes,
        )

    r = import_kit(vault, file, lambda: _read_passphrase(twice=False), ask_replace)

    def human() -> None:
        if r["restored"]:
            extra = f" (replaced key {r['replaced_kid']})" if r["replaced_kid"] else ""
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


@key_group.command("list")
@common
def key_list() -> None:
    """List the key versions this vault's file knows. Never shows a key.

    State is current (the rows use it), pending (a rotation staged it),
    retired (a rotation replaced it; its entry is deleted next) or destroyed.
    "in keyring" says whether its entry memvault/<vault_id>/<kid> exists: a
    destroyed version still present there is another copy's (a backup restored
    with an older kit); `memvault shred` destroys those too.

    \b
    Example:
      memvault key list
    """
    vault = open_vault()
    versions = vault.key_versions()
    doc = {
        "vault_id": vault.vault_id,
        "keys": [
            {"kid": v.kid, "state": v.state, "in_keyring": v.in_keyring, "created_at": v.created_at}
            for v in versions
        ],
    }

    def human() -> None:
        click.echo(f"{'key id':<22}  {'state':<9}  {'in keyring':<10}  created")
        for v in versions:
            present = "yes" if v.in_keyring else "no"
            click.echo(f"{v.kid:<22}  {v.state:<9}  {present:<10}  {v.created_at or 'unknown'}")

    emit(doc, human)
