"""What every group shares: the configuration, side-by-side timing, figures and the table."""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_JSON = HERE / "results.json"

try:
    import sqlcipher3  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # reported as "unavailable", never faked
    sqlcipher3 = None

LIMIT = 20  # get_items(limit=20): the window an agent typically asks for
TURN = 2  # one turn's add_items: the user's message and the assistant's answer


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    quick: bool
    sizes: tuple[int, ...]  # items per session for reads and writes
    rot_items: int  # items in the vault that is rotated and shredded
    rot_sessions: int
    cli_items: int  # items in the vault `status` / `sessions` look at
    reps_read: int
    inner_read: int
    reps_limit: int
    inner_limit: int
    reps_write: int
    inner_write: int
    reps_cli: int
    reps_open: int
    reps_cold_open: int
    reps_rotate: int
    reps_shred: int
    scale: bool = False  # --scale: the million-item figures too
    scale_items: int = 1_000_000

    @classmethod
    def make(cls, quick: bool, scale: bool = False) -> Config:
        if quick:  # 10x smaller everywhere; CI runs it so that the script cannot rot
            return cls(
                scale=scale,
                scale_items=100_000,
                quick=True,
                sizes=(100, 1_000),
                rot_items=10_000,
                rot_sessions=10,
                cli_items=100,
                reps_read=5,
                inner_read=2,
                reps_limit=5,
                inner_limit=20,
                reps_write=7,
                inner_write=10,
                reps_cli=3,
                reps_open=5,
                reps_cold_open=2,
                reps_rotate=2,
                reps_shred=2,
            )
        return cls(
            scale=scale,
            quick=False,
            sizes=(1_000, 10_000),
            rot_items=100_000,
            rot_sessions=100,
            cli_items=1_000,
            reps_read=7,
            inner_read=3,
            reps_limit=9,
            inner_limit=100,
            reps_write=31,
            inner_write=20,
            reps_cli=9,
            reps_open=15,
            reps_cold_open=3,
            reps_rotate=3 if scale else 5,  # --scale: the million-item work takes long
            reps_shred=3,
        )


# --------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------
LOOP = asyncio.new_event_loop()


def run(coro: Any) -> Any:
    return LOOP.run_until_complete(coro)


def side_by_side(
    cases: dict[str, Callable[[], object]], reps: int, inner: int = 1, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each case, interleaved call by call.

    Each repetition is `inner` rounds; a round calls every case once, in an order
    drawn afresh for each round, and each call is timed on its own. A burst of
    load from elsewhere on the machine so lands on all the cases of a round
    rather than on one case's whole sample, and what a call leaves running after
    it returns (a closed connection's server process ending) lands on each case
    equally often: rotating one order kept every case's predecessor fixed, so the
    case after a NullPool session always paid for its connection's teardown. A
    sample is the mean call time over one repetition; the figures are medians of
    these samples.
    """
    names = list(cases)
    order = random.Random(len(names) * 1000 + reps)  # the same orders in every run
    for _ in range(warmup):
        for n in names:
            cases[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(reps):
        total = dict.fromkeys(names, 0.0)
        gc.collect()
        gc.disable()
        try:
            for _ in range(inner):
                for n in order.sample(names, len(names)):
                    fn = cases[n]
                    t0 = time.perf_counter()
                    fn()
                    total[n] += time.perf_counter() - t0
        finally:
            gc.enable()
        for n in names:
            samples[n].append(total[n] / inner)
    return samples


def med(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Figure:
    key: str
    label: str
    unit: str  # "s" or "MB"
    memvault: float | None
    comparisons: dict[str, float | None] = field(default_factory=dict)
    baseline: str | None = None  # the comparison the ratio is taken against
    ratio: float | None = None  # median of the per-repetition ratios (side by side)
    ratio_of_medians: float | None = None
    target: str = "report"
    limit: float | None = None  # the ratio (or the MB) the figure must stay under
    at_least: bool = False  # the figure must reach `limit` instead (a throughput ratio)
    met: bool | None = None  # None: a figure to report, not a target
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)

    def judge(self) -> Figure:
        """The ratio: the median of the per-repetition ratios, each repetition measuring
        memvault and its baseline side by side (call by call); the ratio of the two
        medians is kept too, and a note says when the two disagree on the target."""
        if self.baseline is not None:
            base = self.comparisons.get(self.baseline)
            if self.memvault is not None and base:
                self.ratio_of_medians = self.memvault / base
            mv, other = self.samples.get("memvault"), self.samples.get(self.baseline)
            if mv and other and len(mv) == len(other):
                self.ratio = statistics.median(a / b for a, b in zip(mv, other, strict=True))
            else:
                self.ratio = self.ratio_of_medians
        value = self.ratio if self.baseline is not None else self.memvault
        if self.limit is not None and value is not None:
            self.met = self._within(value)
            other_view = self.ratio_of_medians
            if other_view is not None and self._within(other_view) != self.met:
                self.note += (
                    "; " if self.note else ""
                ) + f"borderline: the ratio of the medians is {other_view:.2f}×"
        return self

    def _within(self, value: float) -> bool:
        assert self.limit is not None
        return value >= self.limit if self.at_least else value <= self.limit


FIGURES: list[Figure] = []


def record(fig: Figure) -> Figure:
    FIGURES.append(fig.judge())
    print(
        f"  {fig.label}: {fmt_value(fig.memvault, fig.unit)}"
        + (f", ratio {fig.ratio:.2f}x" if fig.ratio is not None else ""),
        flush=True,
    )
    return fig


def from_samples(
    key: str,
    label: str,
    samples: dict[str, list[float]],
    baseline: str | None,
    target: str,
    limit: float | None,
    note: str = "",
    unavailable: tuple[str, ...] = (),
) -> Figure:
    comparisons = {k: med(v) for k, v in samples.items() if k != "memvault"}
    comparisons.update(dict.fromkeys(unavailable))  # printed as "unavailable", never faked
    return record(
        Figure(
            key=key,
            label=label,
            unit="s",
            memvault=med(samples.get("memvault")),
            comparisons=comparisons,
            baseline=baseline,
            target=target,
            limit=limit,
            note=note,
            samples=samples,
        )
    )


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------
def fmt_value(x: float | None, unit: str) -> str:
    if x is None:
        return "unavailable"
    if unit == "MB":
        return f"{x:.0f} MB"
    if unit == "x":
        return f"{x:.2f}×"
    if unit == "items/s":
        return f"{x:,.0f} items/s"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1:
        return f"{x * 1e3:.1f} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s"


def table(figs: list[Figure]) -> str:
    head = ["figure", "memvault", "compared with", "ratio", "target", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in figs:
        comps = []
        for name, val in f.comparisons.items():
            text = f"{name} {fmt_value(val, f.unit)}"
            if (
                f.unit == "s"
                and val
                and f.memvault is not None
                and name != f.baseline
                and f.baseline is not None
            ):
                text += f" ({f.memvault / val:.2f}×)"
            comps.append(text)
        ratio = f"{f.ratio:.2f}×" if f.ratio is not None else "—"
        result = "report" if f.met is None else ("met" if f.met else "**missed**")
        if f.met is None and f.limit is not None:
            result = "unavailable"
        lines.append(
            "| "
            + " | ".join(
                [
                    f.label,
                    fmt_value(f.memvault, f.unit),
                    "; ".join(comps) or "—",
                    ratio,
                    f.target,
                    result,
                ]
            )
            + " |"
        )
    return "\n".join(lines)
