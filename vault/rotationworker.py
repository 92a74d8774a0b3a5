"""A rotation worker process: re-encrypts the rows its parent sends, from one key to another.

Started by vault.rotationpool as `python -c BOOT`, with only its stdin and stdout
pipes. It imports nothing of memvault but this module and vault.crypto (the package's
`__init__` would import the SQLite engine: tens of ms per worker for nothing).

The protocol, one frame each way at a time (a 4-byte big-endian length, then a
`marshal` dump: plain lists, tuples, str, int and None):

- in, first: (old master key, new master key). Through the pipe only: never in the
  command line or the environment, which other processes of the user can read.
- in, then: a list of (session_id, message_data); out: the list of `rotate_row`
  results in the same order, or a str saying what failed.

End of input (the parent closed its end, or died: it holds the only write end) ends
the worker, as does a parent that stops reading (a write to a closed pipe fails).
So a SIGKILLed rotator leaves no worker behind longer than the batch it was given.
"""

from __future__ import annotations

import marshal
import os
import signal
import struct
import sys
from typing import IO, Any

from vault import crypto

HEADER = struct.Struct(">I")
# What `rotate_row` says of a row it does not re-encrypt.
SKIP = 0  # under the new key already (written since the switch)
UNREADABLE = 1  # no envelope, another key's, or does not authenticate: kept as it is


def rotate_row(
    old: crypto.Sealer, new: crypto.Sealer, session_id: str, message_data: str
) -> tuple[str, int] | int:
    """One row of a batch, in a worker or in the rotating process alike: its text under
    `new` with its token's timestamp, or SKIP, or UNREADABLE."""
    kid = crypto.kid_of(message_data)
    if kid != old.kid:
        return SKIP if kid == new.kid else UNREADABLE
    # Through the module: the crash tests count rows by wrapping this function.
    stamped = crypto.rotate_row_stamped(old, new, session_id, message_data)
    return UNREADABLE if stamped is None else stamped


def read_frame(stream: IO[bytes]) -> Any:
    """The next frame's object; EOFError at the end of input (or a frame cut short)."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        raise EOFError
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        raise EOFError
    return marshal.loads(body)


def write_frame(stream: IO[bytes], obj: Any) -> None:
    body = marshal.dumps(obj)
    stream.write(HEADER.pack(len(body)))
    stream.write(body)  # (not concatenated: a copy of the frame for nothing)
    stream.flush()


def serve(inp: IO[bytes], out: IO[bytes]) -> int:
    old_key, new_key = read_frame(inp)
    old, new = crypto.Sealer(old_key), crypto.Sealer(new_key)
    del old_key, new_key
    while True:
        try:
            task = read_frame(inp)
        except EOFError:
            return 0
        try:
            result = [rotate_row(old, new, sid, data) for sid, data in task]
        except Exception as exc:  # reported to the parent, which stops the rotation
            write_frame(out, f"{type(exc).__name__}: {exc}")
            return 1
        write_frame(out, result)
        del task, result  # before the next frame is read, not after


def main() -> None:
    # Ctrl-C is the parent's to handle; the worker ends when its input does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = serve(sys.stdin.buffer, sys.stdout.buffer)
    except (EOFError, BrokenPipeError):
        code = 0  # the parent went away
    # No interpreter teardown: nothing to flush, and a parent that died cannot read it.
    os._exit(code)
