"""loglines.LogCursor draining ``.1`` after a rotation when the log is rotated again meanwhile
(a follower behind a slow client, a writer over the cap every LOG_CAP_PERIOD): the new ``.1``
is another generation, and its bytes at the old one's offsets must not be sent as the rest of
the old one (a line spliced from two generations)."""

from __future__ import annotations

from pathlib import Path

from corral import logfiles, loglines


def test_a_second_rotation_mid_drain_splices_no_line(tmp_path: Path) -> None:
    log = tmp_path / "replica-1.log"
    first = b"".join(b"first %04d\n" % i for i in range(100))
    second = b"".join(b"SECOND %04d\n" % i for i in range(100))
    log.write_bytes(first)
    cursor = loglines.LogCursor(log, 0)
    out = [cursor.read(105)[0]]  # a follower behind the writer
    assert logfiles.rotate_if_over(log, 10) is not None
    out.append(cursor.read(105)[0])  # the rest of the first generation, from .1
    with open(log, "ab") as f:
        f.write(second)
    assert logfiles.rotate_if_over(log, 10) is not None
    with open(log, "ab") as f:
        f.write(b"third\n")
    while (step := cursor.read(105)) != (b"", False):
        out.append(step[0])
    lines = b"".join(out).splitlines(keepends=True)
    assert lines[-1] == b"third\n"
    whole = {*first.splitlines(keepends=True), *second.splitlines(keepends=True), b"third\n"}
    for line in lines:  # whole lines, or the start of the first's line the follower got to
        assert line in whole or first.startswith(
            first[:210].rsplit(b"\n", 1)[0] + b"\n" + line[:-1]
        ), line
    assert first[:210] in b"".join(out)
