"""The engines' readings split between a home's balancer workers: each engine read once an
interval, whatever the number of workers.

Why: every worker needs every replica's engine load (a policy weighs it), but an engine's
``/metrics`` is not free where it is built. vLLM's and SGLang's API servers render the
Prometheus text in the Python process that also tokenizes and streams, so W workers that each
read every engine every second cost every engine W renders a second, and each worker a
connection to every engine every second. So the workers split the reading: the replica at
position i of the sorted ready set is read by the worker in slot ``i mod W``, which writes what
it read to ``dataplane/engines-<service>/slot-<N>.json`` (in place, checked: a reader that
meets a write half done does not use it), and every worker takes the other replicas' readings
from the other slots' files.

What keeps it as safe as each worker reading everything:

* A reading is taken from a file only while it is fresh (``STALE``, on the monotonic clock
  every process of the machine shares). A replica whose reader wrote nothing fresh (its worker
  died, is stopped or slow, or has not applied the same table yet) is read by this worker
  itself, as before the split, and written to this worker's file for the others. So a worker
  that dies costs its share of the readings one ``STALE`` span, never the readings themselves.
* An engine that did not answer is written down as tried, so the other workers do not each
  wait out its timeout again.
* The files hold load hints, not state: losing them loses one interval (the next one writes
  them again). They go with their service: the daemon deletes the directory, and each worker
  its own file (:func:`forget`) when the service leaves its table, or when a reading it was
  making ends after that, so a write racing the deletion leaves nothing behind.

With one worker there are no files at all (:func:`corral.dataplane.engines.refresh` alone).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from corral.balancer import LoadBalancer
from corral.dataplane import engines

log = logging.getLogger("corral.worker")

# How old another worker's reading may be and still stand for the engine's load now: past two
# intervals and a half its worker has missed two turns, and this worker reads it itself.
STALE: Final = 2.5 * engines.INTERVAL


def share_dir(directory: Path, service: str) -> Path:
    """Where the workers of ``service`` leave their readings (the data plane's directory)."""
    return directory / f"engines-{service}"


@dataclass(frozen=True)
class Share:
    """This worker's part: its ``slot`` of ``workers``, and where the readings are left."""

    directory: Path
    slot: int
    workers: int

    @classmethod
    def of(cls, home: Path, service: str, slot: int, workers: int) -> Share:
        """The part of the worker in ``slot`` of ``workers`` for ``service`` of ``home``."""
        return cls(share_dir(home / "dataplane", service), slot, workers)

    def readers_of(self, ready: Mapping[int, str]) -> dict[int, int]:
        """Each replica's reading slot: by position in the sorted ids, so every worker with
        the same ready set agrees without a word."""
        return {rid: i % self.workers for i, rid in enumerate(sorted(ready))}


async def refresh(
    lb: LoadBalancer,
    ready: Mapping[int, str],
    path: str,
    before: Mapping[int, Mapping[str, Any]] | None,
    share: Share | None,
) -> dict[int, Any]:
    """:func:`corral.dataplane.engines.refresh`, with the reading split as the module says:
    read this worker's replicas (and those nobody read lately), leave them for the others,
    take theirs; give ``lb`` the whole fleet's load and return it."""
    if share is None or share.workers <= 1:
        return await engines.refresh(lb, ready, path, before)
    now = time.monotonic()
    readers = share.readers_of(ready)
    theirs = _fresh(share, set(ready), now)
    mine = {
        rid: base for rid, base in ready.items() if readers[rid] == share.slot or rid not in theirs
    }
    signals = await engines.read_rated(mine, path, before)
    now = time.monotonic()
    _leave(share, {rid: (now, signals.get(rid)) for rid in mine})
    for rid, got in theirs.items():
        if rid not in mine and got is not None:
            signals[rid] = got
    engines.give(lb, signals)
    return signals


def _slot_file(share: Share, slot: int) -> Path:
    return share.directory / f"slot-{slot}.json"


def _fresh(share: Share, wanted: set[int], now: float) -> dict[int, Mapping[str, Any] | None]:
    """The other slots' readings of ``wanted`` replicas no older than STALE, the newest of
    each (None: tried, no answer)."""
    best: dict[int, tuple[float, Mapping[str, Any] | None]] = {}
    for slot in range(share.workers):
        if slot == share.slot:
            continue
        try:
            entries = _read(_slot_file(share, slot))["readings"].items()
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue  # not written yet, or its worker is gone: this worker reads them
        for key, entry in entries:
            try:
                rid, at, got = int(key), float(entry["at"]), entry["signals"]
            except (ValueError, TypeError, KeyError):
                continue
            if (
                rid not in wanted
                or now - at > STALE
                or (got is not None and not isinstance(got, dict))
            ):
                continue
            if rid not in best or at > best[rid][0]:
                best[rid] = (at, got)
    return {rid: got for rid, (_, got) in best.items()}


def _leave(share: Share, readings: Mapping[int, tuple[float, Mapping[str, Any] | None]]) -> None:
    """Write this slot's readings for the others, in place (one ``pwrite`` at the start of the
    file, headed by the length and CRC-32 of what follows): a new file and a rename each time
    cost 0.3 ms here (ext4 flushes a file renamed over another), this costs a few µs. A reader
    that meets a write half done finds the check wrong and reads those engines itself. A
    failure only costs the others a read of their own."""
    data = json.dumps(
        {"readings": {str(rid): {"at": at, "signals": got} for rid, (at, got) in readings.items()}}
    ).encode()
    blob = b"%d %d\n%b" % (len(data), zlib.crc32(data), data)
    target = _slot_file(share, share.slot)
    try:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o600)
        except FileNotFoundError:
            share.directory.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, blob, 0)
        finally:
            os.close(fd)
    except OSError as exc:
        log.debug("engine readings not shared (%s): %s", target, exc)


def _read(path: Path) -> Any:
    """What :func:`_leave` wrote at ``path`` (ValueError when it is not whole: a write under
    way, or not such a file)."""
    head, _, rest = path.read_bytes().partition(b"\n")
    length, crc = (int(x) for x in head.split())
    data = rest[:length]
    if len(data) != length or zlib.crc32(data) != crc:
        raise ValueError("a write under way")
    return json.loads(data)


def forget(share: Share) -> None:
    """This worker's readings gone with their service, and the directory once no other
    worker's are left in it."""
    with contextlib.suppress(OSError):
        _slot_file(share, share.slot).unlink()
    with contextlib.suppress(OSError):
        share.directory.rmdir()
