"""Wait until the private Secret Service is usable, not just started (scripts/with-keyring).

Usable means: the default collection is unlocked and answers a store, a read and a
delete. Never asks for a prompt. Exit 0 when ready, 3 after the deadline.
"""

import contextlib
import secrets
import sys
import time

import secretstorage
from secretstorage.collection import DEFAULT_COLLECTION

from vault.secretservice import connect  # the daemon's client registered first

DEADLINE = 60.0


def round_trip() -> str | None:
    """None if the keyring works, else what is wrong."""
    with contextlib.closing(connect()) as conn:
        coll = secretstorage.Collection(conn, DEFAULT_COLLECTION)  # raises if absent
        if coll.is_locked():
            return "the default collection is locked"
        token = secrets.token_hex(8)
        query = {"with-keyring-probe": token}
        coll.create_item("with-keyring probe", query, token.encode(), replace=True)
        found = [item.get_secret() for item in coll.search_items(query)]
        for item in coll.search_items(query):
            item.delete()
        return None if found == [token.encode()] else "a stored secret did not read back"


def main() -> int:
    end, last = time.monotonic() + DEADLINE, "no answer"
    while time.monotonic() < end:
        try:
            problem = round_trip()
        except Exception as exc:  # not up yet, or broken: say which at the end
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            return 0
        last = problem
        time.sleep(0.2)
    print(
        f"with-keyring: the private keyring is not usable after {DEADLINE:g} s ({last})",
        file=sys.stderr,
    )
    return 3


if __name__ == "__main__":
    sys.exit(main())
