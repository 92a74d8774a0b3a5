"""`memvault init`, `status`, `ttl` and `log`: the vault as a whole (its file, key, TTL
and audit trail)."""

from __future__ import annotations

from typing import Any

import click

from vault import durations
from vault.cli.common import (
    common,
    duration,
    emit,
    open_any,
    plural,
    say,
    state,
)
from vault.engines.sqlite.schema import DEFAULT_TTL
from vault.keysource.store import source_of


@click.command()
@click.option(
    "--ttl",
    "ttl",
    callback=duration,
    metavar="DURATION",
    help="How long items stay readable: 90s, 15m, 12h, 30d, 2w or never (default 30d).",
)
@click.option(
    "--key-source",
    default="keyring",
    show_default=True,
    metavar="SOURCE",
    help="Where the key lives: keyring, or transit:KEYNAME (an OpenBao or HashiCorp Vault "
    "transit key at VAULT_ADDR/BAO_ADDR, created if missing; the vault keeps the key "
    "wrapped by it). See docs/fleet.md.",
)
@click.option(
    "--transit-mount",
    default=None,
    metavar="PATH",
    help="The transit engine's mount (default transit).",
)
@common
def init(ttl: Any, key_source: str, transit_mount: str | None) -> None:
    """Create the vault file and its random key in the OS keyring (or wrapped by a
    transit key, with --key-source transit:KEYNAME).

    Refuses, changing nothing, if a vault (or any file) is already there.

    \b
    Examples:
      memvault init --ttl 7d
      memvault init --key-source transit:memvault-laptop-42
    """
    from vault.engines.registry import init_vault
    from vault.keysource.store import init_store

    seconds = DEFAULT_TTL if ttl is None else ttl[1]
    store = init_store(key_source, transit_mount)
    vault = init_vault(state().db, ttl=seconds, keystore=store)
    meta = vault.meta()
    data = {
        "path": str(vault.path),
        "vault_id": meta["vault_id"],
        "kid": meta["kid"],
        "ttl": durations.format_duration(seconds),
        "keyring": (store or vault.keystore).name,  # init's store: it knows its address
        "key_source": source_of(meta),
        # The keyring entry is the only copy of the key: losing it loses the history.
        "next": "memvault key export FILE",
    }
    # A transit vault's key is wrapped in the vault: a kit is for losing the transit key.
    held, lost = (
        ("wrapped in the vault by", "losing the transit key loses")
        if store is not None
        else ("stored in", "a lost keyring entry loses")
    )
    emit(
        data,
        lambda: say(
            f"created vault {data['path']}",
            f"  key id  {data['kid']} (key {held} {data['keyring']})",
            f"  ttl     {data['ttl']}",
            "  next    make a recovery kit, kept apart from the vault: "
            f"`memvault key export FILE`; without it, {lost} the history",
        ),
    )


@click.command()
@common
def status() -> None:
    """Path, size, permissions, keyring, key state, TTL and item counts.

    The counts are unverified: items are counted, and judged expired by the
    timestamp each claims, without being authenticated (fast at any size).
    `memvault verify` authenticates every item.

    \b
    Example:
      memvault status --json
    """
    st = open_any().status()

    def human() -> None:
        if st.get("backend") == "postgresql":  # no file, folder or size of its own to show
            say(f"vault      {st['path']}  (PostgreSQL, schema {st['schema']})")
            click.echo(f"files      {st['size']} (no file, folder or mode of memvault's own)")
        else:
            say(f"vault      {st['path']}  ({st['size']} bytes)")
            click.echo(f"folder     mode {st['folder_mode']}")
        for name, f in st["files"].items():
            click.echo(f"  {name:<20} {f['size']:>10} bytes  mode {f['mode']}")
        if st.get("key_source", "keyring") != "keyring":
            say(f"key source {st['key_source']}")
        say(f"keyring    {st['keyring']}")
        key = st["key"] + (f": {st['key_problem']}" if st.get("key_problem") else "")
        say(f"key        {key}")
        say(f"key id     {st['kid']}")
        click.echo(f"ttl        {st['ttl']}")
        counts = f"{plural(st['items'], 'item')} in {plural(st['sessions'], 'session')}"
        counts += f", {st['expired_unverified']} expired by their timestamps"
        click.echo(f"contents   {counts}")
        click.echo("           (unverified counts: `memvault verify` authenticates every item)")
        say(f"rotated    {st['rotated_at'] or 'never'}")
        if st["scrub_pending"]:
            click.echo("scrub      pending (old bytes may remain until the next command)")
        if st.get("rotation"):
            say(
                f"rotation   in progress from {st['rotation']['from_kid']} (rows up to id "
                f"{st['rotation']['done_through_id']} done); both keys read; if no rotation "
                "is running, `memvault rotate` finishes it"
            )
        if st.get("backup_of"):
            say(
                f"backup     of vault {st['backup_of']}, made {st['backed_up_at']}: commands "
                "that write refuse it; `memvault restore` makes it the live vault"
            )
        if st.get("shred_interrupted"):
            click.echo("shred      interrupted: run `memvault shred` again to finish it")

    emit(st, human)


@click.command()
@click.argument("value", required=False, callback=duration, metavar="[DURATION]")
@common
def ttl(value: Any) -> None:
    """Print the vault's TTL, or set it (90s, 15m, 12h, 30d, 2w or never).

    Items older than the TTL are skipped on read and removed by `purge`.

    \b
    Example:
      memvault ttl 7d
    """
    vault = open_any()
    vault.sealer()  # a revoked or missing key fails here, as every keyed command does
    if value is not None:
        vault.set_ttl(value[1])
    text = durations.format_duration(vault.ttl)
    emit(
        {"ttl": text, "ttl_seconds": vault.ttl},
        lambda: click.echo(f"ttl {text}" + (" (set)" if value is not None else "")),
    )


@click.command()
@common
def log() -> None:
    """The audit trail: key and lifecycle events with counts, never content.

    \b
    Example:
      memvault log --json
    """
    rows = open_any().audit_log()
    for r in rows:
        if r["event"] == "ttl":  # stored as seconds; shown as everywhere else (30d, never)
            for k in ("old", "new"):
                r[k] = _ttl_text(r.get(k))

    def human() -> None:
        for r in rows:
            extra = " ".join(f"{k}={v}" for k, v in r.items() if k not in ("at", "event", "kid"))
            say(f"{r['at']}  {r['event']:<10} {r['kid'] or '-':<22} {extra}")

    emit(rows, human)


def _ttl_text(value: Any) -> Any:
    if value is None or value == "never":
        return value
    try:
        return durations.format_duration(int(value))
    except (TypeError, ValueError):
        return value  # a value an older version wrote: shown as it is


COMMANDS = (init, status, ttl, log)
