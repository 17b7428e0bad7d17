"""dataplane.carried kept in dataplane/carried.json: a gone worker is written once, however many
services it served (a rewrite of the whole file per service, on the daemon's event loop, took
seconds per worker with a hundred services), and what is written is all of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.balancer.metrics import merge_stats
from corral.dataplane import carried


def _stats(requests: int) -> dict[str, Any]:
    stats = merge_stats([])
    stats["requests"] = requests
    stats["replicas"] = {"1": {"requests": requests}}
    return stats


def test_a_gone_worker_is_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "dataplane" / "carried.json"
    kept = carried.Carried(path)
    names = [f"svc{i}" for i in range(50)]
    writes: list[Path] = []
    real = carried.os.replace

    def replace(src: Path, dst: Path) -> None:
        writes.append(Path(dst))
        real(src, dst)

    monkeypatch.setattr(carried.os, "replace", replace)
    kept.gone({n: {"stats": _stats(7)} for n in names}, names, (123, 1.5))
    assert writes == [path]
    kept.gone({n: {"stats": _stats(9)} for n in names}, names[:10], (124, 2.5))
    assert len(writes) == 2
    again = carried.Carried(path)
    assert sorted(again._by) == sorted(names[:10])
    assert again.of("svc3") == kept.of("svc3")
    assert again.of("svc3")[0]["requests"] == 16


def test_workers_that_no_longer_run_are_kept_as_one_part(tmp_path: Path) -> None:
    """Every replaced worker left a part of its own, in memory and in the file, for as long as
    the home lived (restart-workers at each upgrade: without end). Only a live worker can take
    its part back, so the dead are merged into one part per service, and the sums stay."""
    path = tmp_path / "dataplane" / "carried.json"
    running = {(1, 1.0)}
    kept = carried.Carried(path, alive=lambda source: tuple(source) in running)
    for pid in range(1, 21):  # twenty workers gone, one of them still running
        kept.gone({"svc": {"stats": _stats(pid)}}, ["svc"], (pid, float(pid)))
    assert len(kept._by["svc"]) == 2  # the live one's own part, and the dead merged
    assert sum(part["requests"] for part in kept.of("svc")) == sum(range(1, 21))
    kept.back((1, 1.0))  # the live one reconnects: its own counts again, not twice
    assert sum(part["requests"] for part in kept.of("svc")) == sum(range(2, 21))
    running.clear()
    again = carried.Carried(path, alive=lambda source: False)
    assert len(again._by["svc"]) == 1
    assert sum(part["requests"] for part in again.of("svc")) == sum(range(2, 21))


def test_a_file_corral_did_not_write_is_no_crash(tmp_path: Path) -> None:
    """The daemon reads carried.json at its start: a key or a part of another shape (a file
    edited by hand, or made by something else) leaves the sums to the live workers, as before
    the file was kept, instead of stopping the daemon."""
    path = tmp_path / "carried.json"
    path.write_text('{"svc": {"not json": {"requests": 3}}}')
    assert carried.Carried(path, alive=lambda source: False).of("svc") == []
