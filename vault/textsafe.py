"""Text that is safe to print: control characters shown, never acted on.

An item, a session id, a path or a value read from the file can hold control
characters. A terminal acts on them: ESC starts sequences that write the
clipboard (OSC 52), clear the screen or retitle the window, and a newline in a
session id starts a forged row of a table. Every human line the CLI prints goes
through one of the two functions here; `--json` output and the JSON Lines export
do not (json.dumps escapes what JSON needs, and they stay exact).

An escaped character reads as Python's repr writes it: `\\n`, `\\t`, `\\x1b`, `\\x85`,
`\\u202e` (so a message quoting a value with `!r` shows it the same way). A
backslash is printed as it is, so that such a quoted value is not escaped twice:
the escaping protects the terminal and is not an encoding to read back (a typed
`\\x1b` looks like an escaped ESC); `--json` gives the exact characters.
"""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls: what a terminal acts on. Item text keeps
# newline and tab, which print as what they are.
_TEXT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# One-line values (ids, paths, table cells, messages) also lose newline and tab,
# and the characters that end a line in some viewers (U+2028, U+2029) or reorder
# the rest of it (the bidirectional controls).
_LINE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _shown(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if char in _SHORT:
        return _SHORT[char]
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _escape(text: str, unsafe: re.Pattern[str]) -> str:
    return unsafe.sub(_shown, text)


def escape_line(text: str) -> str:
    """`text` on one line: every control character (newline and tab too) escaped."""
    return _escape(text, _LINE)


def escape_text(text: str) -> str:
    """An item's text: newlines and tabs kept, every other control character escaped."""
    return _escape(text, _TEXT)
