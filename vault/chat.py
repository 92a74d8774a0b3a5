"""`memvault chat SESSION`: talk to an agent whose history lives in the vault.

Each turn runs `Runner.run_streamed(agent, text, session=vault_session)` and
prints the text deltas as they arrive; the session is `vault.open_session`, so
the history is read from and written to the encrypted vault, and a later run
resumes where this one stopped. Commands typed at the prompt:

    /undo   remove the last turn (the assistant's items and your message)
    /clear  empty the session (like `memvault clear SESSION --yes`)
    /exit   leave (so does end of input, Ctrl-D)

The model needs OPENAI_API_KEY; without it the command says so and exits 4.
SDK tracing is turned off: the conversation goes to the model and nowhere else.

Test-only hook: MEMVAULT_CHAT_TEST_MODEL=module:factory makes the agent use
a scripted model instead of a real one (see `vault.testhooks.chat_test_model`).

This module imports the Agents SDK (about 2 s); `cli` imports it only inside
the `chat` command.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TextIO

from agents import Agent, Model, RunConfig, Runner
from openai.types.responses import ResponseTextDeltaEvent

from vault import backupmark, testhooks
from vault.engine import AnyVault
from vault.errors import BadInput, KeyProblem, UnknownSession, VaultError
from vault.textsafe import escape_line, escape_text

INSTRUCTIONS = (
    "You are a helpful assistant in a terminal chat. Answer concisely. The conversation "
    "history you are given is the user's own, kept encrypted on their machine."
)
HELP = "commands: /undo (remove the last turn), /clear (empty the session), /exit"
_SECRETISH = re.compile(r"(sk-[A-Za-z0-9_\-*]{3})[A-Za-z0-9_\-*]+")


def require_model(model_name: str | None) -> Model | str | None:
    """The injected test model, else the model name (None: the SDK's default).

    Refuses (exit 4) without OPENAI_API_KEY, before the vault is touched.
    """
    injected = testhooks.chat_test_model()
    if injected is not None:
        return injected
    if not os.environ.get("OPENAI_API_KEY"):
        raise KeyProblem(
            "OPENAI_API_KEY is not set; memvault chat needs it to reach the model: "
            "export OPENAI_API_KEY=... and run it again"
        )
    return model_name


def _role(item: Any) -> str | None:
    if isinstance(item, dict):
        role = item.get("role")
        return role if isinstance(role, str) else None
    return None


def last_turn_size(items: list[Any]) -> int:
    """How many of the newest items form the last turn: the last user item and after."""
    for i in range(len(items) - 1, -1, -1):
        if _role(items[i]) == "user":
            return len(items) - i
    return 0


def _one_line(text: str) -> str:
    return _SECRETISH.sub(r"\1…", " ".join(escape_line(text).split()))[:300]


class Chat:
    """The conversation loop; `run()` returns the exit code."""

    def __init__(
        self,
        vault: AnyVault,
        session_id: str,
        model: Model | str | None,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
        read_line: Callable[[str], str | None] | None = None,
    ) -> None:
        self.vault = vault
        self.session_id = session_id
        self.out = out
        self.err = err
        self.interactive = sys.stdin.isatty()
        if self.interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing and history for input())
        self.read_line = read_line or self._read_line
        kwargs: dict[str, Any] = {} if model is None else {"model": model}
        self.agent: Agent[Any] = Agent(name="memvault chat", instructions=INSTRUCTIONS, **kwargs)
        self.session: Any = None

    def say(self, text: str) -> None:
        print(escape_line(text), file=self.out, flush=True)

    def _read_line(self, prompt: str) -> str | None:
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\r\n")

    async def run(self) -> int:
        self.session = self.vault.session(self.session_id)
        try:
            items = await self.session.get_items()
            if items:
                turns = sum(1 for i in items if _role(i) == "user")
                self.say(
                    f"resumed session {self.session_id}: {len(items)} item(s) loaded "
                    f"({turns} turn(s)) from {self.vault.path}"
                )
            else:
                self.say(f"new session {self.session_id} in {self.vault.path}")
            self.say(HELP)
            while True:
                line = await asyncio.to_thread(self.read_line, "you> ")
                if line is None:
                    break
                text = line.strip()
                if not text:
                    continue
                if text.startswith("/"):
                    if not await self.command(text):
                        break
                    continue
                await self.turn(text)
        finally:
            self.session.close()
        n = len(self.vault.items(self.session_id)[0]) if self._exists() else 0
        self.say(f"bye: session {self.session_id} holds {n} item(s), encrypted")
        return 0

    def _exists(self) -> bool:
        return self.session_id in self.vault.session_ids()

    async def command(self, text: str) -> bool:
        """Run a /command; False means leave."""
        name = text.split()[0].lower()
        if name in ("/exit", "/quit"):
            return False
        if name == "/undo":
            items = await self.session.get_items()
            n = last_turn_size(items)
            if n == 0:
                self.say("nothing to undo")
                return True
            popped = (await asyncio.to_thread(self.vault.pop, self.session_id, n)).items
            oldest = popped[-1] if popped else None
            if _role(oldest) != "user":
                self.say(
                    f"warning: removed {len(popped)} item(s), but the oldest was not your "
                    "message; check with `memvault show`"
                )
            else:
                self.say(f"undid the last turn ({len(popped)} item(s) removed)")
            return True
        if name == "/clear":
            try:
                n = (await asyncio.to_thread(self.vault.clear, self.session_id)).deleted
            except UnknownSession:
                n = 0
            self.say(f"cleared session {self.session_id} ({n} item(s) deleted)")
            return True
        if name == "/help":
            self.say(HELP)
            return True
        self.say(f"unknown command {name}; {HELP}")
        return True

    async def turn(self, text: str) -> None:
        before = len(await self.session.get_items())
        printed = False
        self.out.write("assistant> ")
        self.out.flush()
        try:
            result = Runner.run_streamed(
                self.agent,
                text,
                session=self.session,
                run_config=RunConfig(tracing_disabled=True),
            )
            async for event in result.stream_events():
                if event.type == "raw_response_event" and isinstance(
                    event.data, ResponseTextDeltaEvent
                ):
                    # A reply is item text: its own escape sequences never reach the terminal.
                    self.out.write(escape_text(event.data.delta))
                    self.out.flush()
                    printed = printed or bool(event.data.delta)
            if not printed and result.final_output is not None:
                self.out.write(escape_text(str(result.final_output)))
            self.out.write("\n")
            self.out.flush()
        except VaultError:
            self.out.write("\n")
            raise
        except Exception as exc:  # model, network or SDK failure: report, keep the history whole
            self.out.write("\n")
            self.out.flush()
            after = len(await self.session.get_items())
            dropped = ""
            if after > before:
                await asyncio.to_thread(self.vault.pop, self.session_id, after - before)
                dropped = f"; the {after - before} item(s) of this failed turn were removed"
            print(
                f"memvault: error: the model call failed ({type(exc).__name__}: "
                f"{_one_line(str(exc))}){dropped}",
                file=self.err,
                flush=True,
            )


def run_chat(db: str | None, session_id: str, model_name: str | None) -> int:
    """Entry point of `memvault chat`: checks, then the loop."""
    if not session_id.strip():
        raise BadInput("the session id is empty")
    model = require_model(model_name)
    from vault.engines.registry import open_vault

    vault = open_vault(db)  # a file, or PostgreSQL: the same session over either
    backupmark.refuse_writes(vault, "`memvault chat`")  # before a turn is typed, not after
    vault.sealer()  # the key is checked before the first prompt
    return asyncio.run(Chat(vault, session_id, model).run())
