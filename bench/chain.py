"""The history chain's cost per item beside the envelope's, side by side in one run.

A micro-figure, not a target (issue 21's 5 % is judged on add_items and get_items
once the chain is wired): `python -m bench.chain [items]`. No keyring, no file.
Each pair is interleaved round by round, and the median of the rounds is printed.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from bench.data import make_items
from vault import chain, crypto

ROUNDS = 7
VAULT_ID = "0" * 32


def _per_item(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) / n * 1e6


def _check(key: chain.ChainKey, text: str, raw: str) -> bool:
    link = chain.Link.decode(raw)  # a read decodes the stored link too
    return link is not None and chain.link_ok(key, link, text)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 2000
    sealer = crypto.Sealer(crypto.generate_key())
    key = chain.chain_key(sealer.master_key, VAULT_ID)
    items = list(make_items(n, seed=21))
    texts = [sealer.seal("s", item) for item in items]
    links, _ = chain.extend(key, "s", chain.new_head(key, "s"), texts)
    stored = [(t, lk.encode()) for lk, t in zip(links, texts, strict=True)]
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "add (seal vs link)": (
            lambda: [sealer.seal("s", item) for item in items],
            lambda: chain.extend(key, "s", chain.new_head(key, "s"), texts),
        ),
        "read (open vs check link)": (
            lambda: [sealer.open("s", t, None) for t in texts],
            lambda: [_check(key, t, raw) for t, raw in stored],
        ),
    }
    print(f"{n} items, median of {ROUNDS} rounds, microseconds per item")
    print(f"{'':28}{'Fernet':>10}{'chain':>10}{'chain/Fernet':>14}")
    for name, (fernet, link) in pairs.items():
        a, b = [], []
        for _ in range(ROUNDS):
            a.append(_per_item(fernet, n))
            b.append(_per_item(link, n))
        fa, fb = statistics.median(a), statistics.median(b)
        print(f"{name:28}{fa:10.1f}{fb:10.1f}{fb / fa:13.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
