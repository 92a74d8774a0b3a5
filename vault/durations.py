"""TTL durations as people type them (`90s`, `15m`, `12h`, `30d`, `2w`, `never`).

Kept apart from the cryptography: the CLI parses and prints durations without
needing the envelope code, and `None` stands for "never expires" throughout.
"""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$", re.IGNORECASE)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_TTL = 100 * 365 * 86400
EXAMPLES = "90s, 15m, 12h, 30d, 2w or never"


def parse_duration(text: str) -> int | None:
    """`90s`, `15m`, `12h`, `30d`, `2w`, or `never` (None)."""
    if text.strip().lower() == "never":
        return None
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration; use e.g. {EXAMPLES}")
    if not m.group(2):
        # `ttl 1` once meant one second, silently: a number alone is refused so that
        # nobody gets seconds when they meant days.
        raise ValueError(
            f"{text!r} has no unit; a duration names one, e.g. {m.group(1)}s, {m.group(1)}m, "
            f"{m.group(1)}h or {m.group(1)}d ({EXAMPLES})"
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a positive duration; use at least 1s, or never")
    if seconds > MAX_TTL:
        raise ValueError(f"{text!r} is longer than 100 years; use never for no expiry")
    return seconds


def format_duration(seconds: int | None) -> str:
    """The shortest exact spelling: 2w, 30d, 12h, 15m, 90s, or never."""
    if seconds is None:
        return "never"
    for unit, size in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
