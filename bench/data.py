"""The items: agent turns of about 800 bytes of JSON each, from a fixed seed."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from typing import Any

WORDS = tuple(
    " ".join(
        [
            "the agent reads the ticket and checks the build log before it answers with a short",
            "plan that names each file it will touch and why the test failed on the second run",
            "because the fixture kept a stale key so the vault refused the write and the user",
            "asked for a summary of what changed since yesterday including the release notes",
            "and the open questions",
        ]
    ).split(" ")
)


def _text(rng: random.Random, length: int) -> str:
    words: list[str] = []
    size = 0
    while size < length:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:length]


def make_item(rng: random.Random, i: int) -> dict[str, Any]:
    """One Responses-API input item of 700-900 bytes of JSON, like an agent's turns."""
    target = rng.randint(700, 900)
    kind = i % 4
    call = f"call_{rng.getrandbits(96):024x}"
    item: dict[str, Any]
    if kind == 0:
        item = {"role": "user", "content": ""}
        key: tuple[Any, ...] = ("content",)
    elif kind == 1:
        item = {
            "type": "function_call",
            "id": f"fc_{rng.getrandbits(128):032x}",
            "call_id": call,
            "name": "search_notes",
            "arguments": "",
            "status": "completed",
        }
        key = ("arguments",)
    elif kind == 2:
        item = {"type": "function_call_output", "call_id": call, "output": ""}
        key = ("output",)
    else:
        item = {
            "id": f"msg_{rng.getrandbits(128):032x}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "", "annotations": []}],
        }
        key = ("content", 0, "text")
    room = max(0, target - len(json.dumps(item)))
    text = _text(rng, room)
    if kind == 1:
        text = json.dumps({"query": text[: max(0, room - 14)]})
    holder: Any = item
    for k in key[:-1]:
        holder = holder[k]
    holder[key[-1]] = text
    return item


def make_items(n: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for i in range(n):
        yield make_item(rng, i)


def chunked(it: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for x in it:
        batch.append(x)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
