"""A follower of a log that was emptied by hand (no ``.1``: ``: > log``) and written past the
follower's place before its next read starts the new content at 0, not in its middle."""

from __future__ import annotations

import os
from pathlib import Path

from corral.loglines import LogCursor


def test_a_log_emptied_by_hand_and_grown_past_the_place_is_read_from_zero(
    tmp_path: Path,
) -> None:
    path = tmp_path / "replica_1.log"
    with open(path, "ab", buffering=0) as writer:
        writer.write(b"old line one\nold line two\n")
        cursor = LogCursor(path, 0)
        assert cursor.read() == (b"old line one\nold line two\n", False)
        os.truncate(path, 0)  # what `: > replica_1.log` does; the app appends on at 0
        new = b"".join(b"new line %d\n" % i for i in range(10))
        writer.write(new)
        got = b""
        for _ in range(5):
            chunk, _fresh = cursor.read()
            got += chunk
        assert got == new
