"""Shred's order, once for both engines: marker, key versions, then rows.

An engine provides the steps (`ShredSteps`), each run under the lock it holds for
the whole shred; `keys_then_rows` puts them in the order that makes a shred safe
to cut off at any instant:

1. The marker (`shred_started`, with the counts) is made durable before any key
   goes, so that a run cut off afterwards is finished by the next with the same
   report (`resumed`). A first run whose keys could not go leaves no marker where
   the engine can take it back (`unmark`).
2. Every key version the vault ever named goes from this keyring, except other
   copies' keys (vault.keyjournal.destroy_entries), and a transit vault's transit
   key is deleted (or the report says the operator must); a backup's versions are the
   live vault's and stay (`keys_kept`). From here on a crash leaves only
   unreadable ciphertext. A resumed run destroys what it finds now and keeps what
   the cut-off one reported: the cut-off run may have destroyed them already, so
   they are gone either way. Once the marker records their fate, a resumed run
   finishes without a usable keyring too.
3. The outcome is recorded (`keys_gone`), then the rows go (`destroy_rows`).

Then the engine destroys what held the rows (a file's bytes, PostgreSQL's tables
and schema), and `finish` removes what a killed forced export left.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from vault import exportdirs, testhooks
from vault.engines.sqlite.schema import utcnow
from vault.errors import KeyProblem
from vault.keys import KeyStore
from vault.keysource.store import destroy_versions

MARK = "shred_started"
# What the marker records, so that a run cut off is finished with the same report.
SHRED_FIELDS = (
    "vault_id",
    "kid",
    "sessions",
    "items",
    "key_destroyed",
    "destroyed_kids",
    "other_copies_kids",
    "foreign_kid",
)
KEY_FIELDS = SHRED_FIELDS[4:]


class ShredSteps(Protocol):
    """What an engine does for `shred`, each step under the lock held for the whole shred."""

    # The failpoints after the marker and after the keys (the crash tests name them).
    after_mark: str
    after_keys: str

    def read_meta(self) -> dict[str, str]: ...

    def count(self) -> tuple[int, int]:
        """(sessions, items) as the vault holds them now."""
        ...

    def mark(self, meta: dict[str, str], marker: str) -> None:
        """A first run: make `marker` durable before any key goes."""
        ...

    def unmark(self) -> None:
        """A first run whose keys could not go: take the marker back if the engine can."""
        ...

    def keys_kept(self, meta: dict[str, str]) -> dict[str, Any] | None:
        """Why this vault's key versions stay (a backup's are the live vault's), or None."""
        ...

    def key_versions(self, meta: dict[str, str], kid: str) -> tuple[set[str], set[str]]:
        """(every version the vault ever named, those it uses or staged itself)."""
        ...

    def keys_gone(self, kids: set[str], marker: str) -> None:
        """Record that `kids` are destroyed, and `marker` with the outcome."""
        ...

    def destroy_rows(self) -> None: ...


def marker(report: dict[str, Any]) -> str:
    return json.dumps({k: report.get(k) for k in SHRED_FIELDS})


def keys_then_rows(
    steps: ShredSteps, keystore: Callable[[dict[str, str]], KeyStore], report: dict[str, Any]
) -> None:
    """Marker, key versions, then rows, in that order (the module doc); fills `report`."""
    meta = steps.read_meta()
    vault_id = meta["vault_id"]
    kid = meta.get("revoked_kid", meta["kid"])
    report["vault_id"], report["kid"] = vault_id, kid
    first = MARK not in meta
    if not first:
        # A shred was cut off: finish it as it began.
        report.update(json.loads(meta[MARK]))
        report["resumed"] = True
        if report.get("key_destroyed") is None:
            # Cut off before the keys' fate was recorded: the rows are all there still.
            report["sessions"], report["items"] = steps.count()
    else:
        report["sessions"], report["items"] = steps.count()
        report.update(dict.fromkeys(KEY_FIELDS))
        steps.mark(meta, marker(report))
    testhooks.failpoint(steps.after_mark)
    kept = steps.keys_kept(meta)
    if kept is not None:
        report.update(kept)
        report.update(key_destroyed=False, destroyed_kids=[], other_copies_kids=[])
        report["foreign_kid"] = None
        steps.destroy_rows()
        return
    recorded = report.get("key_destroyed") is not None
    try:
        ks = keystore(meta)
        ks.check_usable()
        kids, in_use = steps.key_versions(meta, kid)
        # A transit vault's keyring leftovers and its transit key go too.
        outcome = destroy_versions(ks, vault_id, kids, in_use)
    except KeyProblem:
        if not recorded:
            if first:
                steps.unmark()
            raise
        # The cut-off run recorded the keys' fate: the rest needs no keyring.
        kids, outcome = set(), None
    except BaseException:
        if first:
            steps.unmark()
        raise
    if outcome is not None:
        merge(report, outcome)
        if outcome.get("transit_key") == "deleted":
            report["key_destroyed"] = True
    steps.keys_gone(kids, marker(report))
    testhooks.failpoint(steps.after_keys)
    steps.destroy_rows()


def merge(report: dict[str, Any], outcome: dict[str, Any]) -> None:
    """This run's key outcome into the report; a resumed run keeps what the cut-off
    one destroyed, adding what it finds now."""
    before = report.get("key_destroyed")
    if before is not None and not outcome["key_destroyed"]:
        return  # recorded by the cut-off run, and nothing more found now
    destroyed = set(report.get("destroyed_kids") or []) | set(outcome["destroyed_kids"])
    others = set(report.get("other_copies_kids") or []) | set(outcome["other_copies_kids"])
    resumed_blind = report.get("resumed") and before is None
    report.update(outcome)
    report["destroyed_kids"], report["other_copies_kids"] = sorted(destroyed), sorted(others)
    # A run cut off after its marker may have destroyed them: gone either way.
    report["key_destroyed"] = bool(destroyed) or bool(resumed_blind)


def finish(report: dict[str, Any], files: list[dict[str, Any]], folders: Iterable[Path]) -> None:
    """The report's last fields: what was removed, including what a killed `export
    --force` of this vault left in `folders`, and when."""
    report["files"] = files + exportdirs.clean(set(folders))
    report["at"] = utcnow()
