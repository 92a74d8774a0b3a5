"""`memvault` commands around the agent: import a plaintext SQLiteSession file,
run the demo's four checks, chat. Logic in vault.importer, vault.demo and vault.chat,
imported inside each command (the Agents SDK only by demo and chat).
"""

from __future__ import annotations

import click

from vault.cli.common import (
    PATH,
    SESSION,
    common,
    confirm,
    emit,
    hide_options,
    open_any,
    plural,
    progress,
    refuse_option,
    refuse_vault_target,
    say,
    state,
)
from vault.errors import VaultError
from vault.textsafe import escape_line, escape_text


@click.command()
@click.option("--keep", is_flag=True, help="Keep the throwaway vault folder for inspection.")
@common
def demo(keep: bool) -> None:
    """Show that the history is kept, encrypted, across processes: four checks
    in a throwaway vault, each step its own process.

    \b
    1. write: an agent turn stores a code name, and the process exits;
    2. recall: a new process reads the history back and the model is given
       the code name;
    3. clear: `memvault clear` empties the session, another one is untouched;
    4. negative control: the same session id without the vault finds nothing.

    Uses the real model when OPENAI_API_KEY is set, else an offline stand-in
    that can only answer from the history it is given. It makes its own vault
    and prints a narrative: the global --db and --json are refused (exit 2).

    \b
    Example:
      memvault demo
    """
    if state().db is not None:
        refuse_option("--db", "demo", "it always works in a throwaway vault of its own")
    if state().json:
        refuse_option("--json", "demo", "it prints a narrative, not a document")
    from vault.demo import run_demo

    ok = run_demo(keep=keep, echo=lambda text: click.echo(escape_text(text)))
    if not ok:
        raise VaultError("the demo found a failing check (see above)")


hide_options(demo, "db", "as_json")  # refused above: its --help does not offer them


@click.command("import")
@click.argument("plain_db", metavar="PLAIN_DB", type=PATH)
@click.option(
    "--session", "session_id", metavar="ID", type=SESSION, help="Import only this session."
)
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
    or holding tables or sessions the import would not carry over (exit 1). The
    vault itself, or its -wal, -shm or -journal, by any name, is refused (exit 2).

    \b
    Example:
      memvault import carnet.db
      memvault import app.db --session carnet-local --sessions-table my_sessions \\
          --messages-table my_messages
      memvault import carnet.db --shred-source --yes
    """
    from vault.targets import NOT_A_SOURCE

    refuse_vault_target(plain_db, NOT_A_SOURCE)
    vault = open_any()
    vault.sealer()  # fail on the key before reading anything
    importer = vault.importer(plain_db, session_id, sessions_table, messages_table, shred_source)
    where = str(vault.path)
    with importer:
        plan = importer.plan
        if shred_source:
            confirm(
                f"Import {plural(len(plan.sessions), 'session')} "
                f"({plural(plan.total_items, 'item')}) into the vault {where}, then "
                f"destroy {plan.source} and its side files?",
                yes,
            )
        with progress(plan.total_items, "importing") as bar:
            r = importer.run(progress=bar)

    def human() -> None:
        say(
            f"imported {plural(r['items'], 'item')} in "
            f"{plural(len(r['sessions']), 'session')} from "
            f"{r['source']} (tables {r['tables']['sessions']}/{r['tables']['messages']}), "
            f"sealed with key {r['kid']}; counts and contents verified"
        )
        for s in r["sessions"]:
            say(f"  {escape_line(s['session_id']):<30} {plural(s['items'], 'item'):>11}")
        for s in r["already_imported"]:  # by a killed run of the same command
            say(
                f"  {escape_line(s['session_id']):<30} {plural(s['items'], 'item'):>11}  "
                "already imported by the interrupted run; not imported again"
            )
        shredded = r["source_shredded"]
        if shredded:
            say(
                f"destroyed the source: {plural(shredded['rows'], 'row')} deleted, then "
                + ", ".join(f"{f['name']} ({f['size']} bytes)" for f in shredded["files"])
                + " overwritten and removed"
            )

    emit(r, human)


@click.command()
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
    from vault.chat import run_chat

    return run_chat(state().db, session_id, model)


hide_options(chat, "as_json")  # refused above: its --help does not offer it


COMMANDS = (
    demo,
    import_cmd,
    chat,
)
