"""Finding items by their text (`memvault search`): decrypt, scan, forget.

No index is built and nothing is written anywhere: each item is decrypted,
its text (`export.item_text`) scanned, and only the hits' short excerpts are
kept. Expired items are skipped unless asked for; items that do not
authenticate are counted, never scanned.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vault.crypto import ItemState
from vault.errors import BadInput
from vault.export import ItemSource, iso_time, item_text, select_sessions
from vault.textsafe import escape_line

EXCERPT_CONTEXT = 30  # characters shown on each side of a match


@dataclass
class Hit:
    session_id: str
    position: int  # 1-based among the session's stored items, as in `memvault export`
    role: str
    timestamp: str | None
    expired: bool
    excerpt: str


@dataclass
class Found:
    pattern: str
    regex: bool
    hits: list[Hit] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)  # searched
    items: int = 0  # scanned
    expired_skipped: int = 0
    unreadable: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["hits"] = [dict(h.__dict__) for h in self.hits]
        return out


def compile_pattern(pattern: str, regex: bool = False) -> re.Pattern[str]:
    """A case-insensitive matcher: a plain substring, or a Python regex with `regex`.

    Raises BadInput (exit 2) for an empty pattern or a regex that does not compile.
    """
    if pattern == "":
        raise BadInput("the search pattern is empty; give some text to look for")
    if not regex:
        return re.compile(re.escape(pattern), re.IGNORECASE)
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise BadInput(
            f"bad regular expression {pattern!r}: {exc}; fix it, or drop --regex to look "
            "for the text as it is"
        ) from None
    except (OverflowError, RecursionError):
        # `a{99999999999}` overflows the regex compiler and deep nesting exhausts its stack:
        # bad input like any other pattern that does not compile.
        raise BadInput(
            f"regular expression {pattern!r} is too large to compile (a repeat count or a "
            "nesting too deep); use a smaller one, or drop --regex to look for the text as it is"
        ) from None


def excerpt(text: str, match: re.Match[str], context: int = EXCERPT_CONTEXT) -> str:
    """The match with some text around it, on one printable line."""
    start, end = max(0, match.start() - context), min(len(text), match.end() + context)
    # A model's text may hold terminal control sequences: shown escaped, never replayed.
    flat = escape_line(" ".join(text[start:end].split()))
    return ("…" if start else "") + flat + ("…" if end < len(text) else "")


def search(
    vault: ItemSource,
    pattern: str,
    session_ids: Sequence[str] = (),
    regex: bool = False,
    include_expired: bool = False,
    now: int | None = None,
) -> Found:
    """Every item of the sessions (all when none are named) whose text matches.

    One hit per matching item, excerpted around its first match.
    """
    matcher = compile_pattern(pattern, regex)
    vault.sealer()  # the key errors first, as every keyed command
    found = Found(pattern, regex)
    for sid in select_sessions(vault, session_ids):
        found.sessions.append(sid)
        opened = vault.opened_items(sid, now=now, include_expired=include_expired)
        for position, one in enumerate(opened, 1):
            if one.state is ItemState.UNREADABLE:
                found.unreadable += 1
                continue
            expired = one.state is ItemState.EXPIRED
            if expired and not include_expired:
                found.expired_skipped += 1
                continue
            found.items += 1
            it = item_text(one.item)
            text = it.searchable
            match = matcher.search(text)
            if match:
                found.hits.append(
                    Hit(
                        sid,
                        position,
                        it.role,
                        iso_time(one.timestamp),
                        expired,
                        excerpt(text, match),
                    )
                )
    return found
