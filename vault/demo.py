"""`memvault demo`: the guide's four checks, each step in a process of its own.

    1. write: a turn stores a code name, the process exits;
    2. recall: a new process finds the items and the model is given the code name;
    3. clear: `memvault clear` empties the session, another session is untouched;
    4. negative control: the same id on an in-memory SQLiteSession finds nothing.

The steps run as `python -m vault.demo STEP ...`, so a live Python object can
never stand in for the file. Without OPENAI_API_KEY the model is an offline
stand-in (the SDK's ScriptedModel) that answers only from the history it is given.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

SESSION = "carnet-local"
OTHER_SESSION = "autre-session"
INSTRUCTIONS = (
    "Answer in one sentence. If the fact asked for is not in this session's history, "
    "say you do not have it. Do not look for it anywhere else."
)
CODE_PATTERN = re.compile(r"\b[A-Z]{3,}-\d{2,}\b")


# --------------------------------------------------------------------------
# The model: real when OPENAI_API_KEY is set, else a stand-in bound to history.
# --------------------------------------------------------------------------
def user_texts(items: Any) -> list[str]:
    """The user texts in the model's input, oldest first."""
    if isinstance(items, str):
        return [items]
    texts = []
    for item in items or []:
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(c.get("text", "") for c in content if isinstance(c, dict))
    return texts


def offline_answer(model_input: Any) -> str:
    """Answer only from the history given: find a code name in earlier user turns."""
    texts = user_texts(model_input)
    earlier, last = texts[:-1], (texts[-1] if texts else "")
    if CODE_PATTERN.search(last) and "?" not in last:
        return f"Noted: {CODE_PATTERN.search(last).group(0)}."  # type: ignore[union-attr]
    for text in reversed(earlier):
        found = CODE_PATTERN.search(text)
        if found:
            return f"The code name you gave me is {found.group(0)}."
    return "I do not have that code name in this session's history."


def make_model() -> tuple[Any, str]:
    if os.environ.get("OPENAI_API_KEY"):
        return None, "the real model (OPENAI_API_KEY is set; SDK default model)"
    from agents.testing import ModelStep, ScriptedModel, assistant_message

    def respond(call: Any) -> Any:
        return [assistant_message(offline_answer(call.input))]

    return (
        ScriptedModel([ModelStep.respond(respond) for _ in range(4)]),
        "the offline stand-in model (no OPENAI_API_KEY): it answers only from the history "
        "it is given",
    )


async def _turn(session: Any, text: str) -> dict[str, Any]:
    from agents import Agent, Runner

    model, which = make_model()
    kwargs = {"model": model} if model is not None else {}
    agent = Agent(name="Carnet", instructions=INSTRUCTIONS, **kwargs)
    before = len(await session.get_items())
    result = await Runner.run(agent, text, session=session)
    out: dict[str, Any] = {
        "items_before": before,
        "answer": str(result.final_output),
        "items_after": len(await session.get_items()),
        "model": which,
    }
    if model is not None and model.calls:
        out["model_input"] = json.dumps(model.calls[-1].input, ensure_ascii=False, default=str)
    return out


# --------------------------------------------------------------------------
# Steps, each run in its own process
# --------------------------------------------------------------------------
async def step(name: str, db: str, code: str) -> dict[str, Any]:
    import vault

    if name == "write":
        session = vault.open_session(SESSION, db)
        out = await _turn(session, f"Remember this code name for this session: {code}. Repeat it.")
        other = vault.open_session(OTHER_SESSION, db)
        await other.add_items([{"role": "user", "content": "a turn of another session"}])
        return out
    if name == "ask":
        session = vault.open_session(SESSION, db)
        return await _turn(session, "What code name did I give you in this session?")
    if name == "memory":
        from agents import SQLiteSession

        mem = SQLiteSession(SESSION)  # no path: the documented :memory: default
        return {"items_before": len(await mem.get_items())}
    raise SystemExit(f"unknown step {name}")


def _run_step(name: str, db: Path, code: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "vault.demo", name, str(db), code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"step {name} failed: {tail}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_demo(keep: bool = False, echo: Callable[[str], Any] = print) -> bool:
    """Walk through the four checks; True when every verdict is PASS."""
    from vault.engines.sqlite.shred import shred
    from vault.engines.sqlite.vault import Vault

    folder = Path(tempfile.mkdtemp(prefix="memvault-demo-"))
    db = folder / "carnet.db"
    code = f"NORD-{secrets.randbelow(90) + 10}{secrets.randbelow(900) + 100}"
    verdicts: list[bool] = []

    def verdict(ok: bool, text: str) -> None:
        verdicts.append(ok)
        echo(f"   {'PASS' if ok else 'FAIL'}  {text}")

    try:
        vault = Vault.init(db, ttl=3600)
        echo(f"throwaway vault {db}, id {vault.vault_id} (key in {vault.keystore.name})")
        echo(f"model: {make_model()[1]}")
        echo(f"code name for this run: {code}\n")

        echo("1. write the fact, then exit (process 1)")
        out = _run_step("write", db, code)
        echo(f"   answer: {out['answer']}")
        items, _, _ = Vault.open(db).items(SESSION)
        stored = json.dumps(items, ensure_ascii=False)
        raw = b"".join(
            p.read_bytes()
            for p in (db, *[db.with_name(db.name + s) for s in ("-wal", "-shm")])
            if p.exists()
        )
        verdict(db.exists(), "the process exited and the vault file is on disk")
        verdict(
            code in stored, f"a stored item decrypts to the code name ({out['items_after']} items)"
        )
        verdict(
            code.encode() not in raw, "the raw bytes of the file, -wal and -shm do not contain it"
        )

        echo("\n2. recall in a new process (process 2)")
        out = _run_step("ask", db, code)
        echo(f"   items before the turn: {out['items_before']}; answer: {out['answer']}")
        verdict(out["items_before"] > 0, "the new process found the stored items")
        if "model_input" in out:
            verdict(code in out["model_input"], "the model's input contained the code name")
        verdict(code in out["answer"], "the answer cites the code name")

        echo("\n3. clear, then ask again (memvault clear, then process 3)")
        proc = subprocess.run(
            [sys.executable, "-m", "vault", "--db", str(db), "clear", SESSION, "--yes"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        echo(f"   {proc.stdout.strip() or proc.stderr.strip()}")
        out = _run_step("ask", db, code)
        echo(f"   items before the turn: {out['items_before']}; answer: {out['answer']}")
        verdict(proc.returncode == 0 and out["items_before"] == 0, "the session is empty")
        verdict(code not in out["answer"], "the answer no longer gives the code name")
        others = Vault.open(db).items(OTHER_SESSION)[0]
        verdict(len(others) == 1, f"the other session is untouched ({len(others)} item)")

        echo("\n4. negative control: same id, in-memory SQLiteSession (process 4)")
        out = _run_step("memory", db, code)
        verdict(out["items_before"] == 0, f"nothing found ({out['items_before']} items)")
    except Exception as exc:  # report, then still clean up
        verdict(False, f"{type(exc).__name__}: {exc}")
    finally:
        if keep:
            echo(f"\nkept {folder} (its key stays in the keyring until `memvault --db {db} shred`)")
        else:
            try:
                if db.exists():
                    shred(db)
                shutil.rmtree(folder, ignore_errors=True)
                echo("\nremoved the throwaway vault and its keyring entry")
            except Exception as exc:
                echo(f"\ncould not remove {folder}: {exc}")
                verdicts.append(False)
    ok = bool(verdicts) and all(verdicts)
    echo(f"\n{'all checks passed' if ok else 'some checks FAILED'}")
    return ok


if __name__ == "__main__":
    name, db_arg, code_arg = sys.argv[1:4]
    print(json.dumps(asyncio.run(step(name, db_arg, code_arg)), ensure_ascii=False))
