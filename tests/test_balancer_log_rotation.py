"""A `--load-balancer` follower does not lose the lines the size cap moved to a worker log's
`.1` before the follower read them (up to a poll's worth at each rotation)."""

from __future__ import annotations

from pathlib import Path

from corral import logfiles, loglines


def _line(i: int) -> bytes:
    return f"2026-12-07 07:00:{i:02d},000 INFO worker-0 balancer svc up {i}\n".encode()


def test_balancer_follower_reads_what_the_cap_moved_to_dot_one(tmp_path: Path) -> None:
    (tmp_path / "dataplane").mkdir()
    log = tmp_path / "dataplane" / "worker-0.log"
    log.write_bytes(b"".join(_line(i) for i in range(3)))
    first, positions = loglines.balancer_lines(tmp_path, "svc", {})
    assert len(first) == 3
    with open(log, "ab") as f:
        f.write(_line(10) + _line(11))
    assert logfiles.rotate_if_over(log, 10) is not None
    with open(log, "ab") as f:
        f.write(_line(20))
    after, _ = loglines.balancer_lines(tmp_path, "svc", positions)
    assert after == [_line(10), _line(11), _line(20)]
