"""loglines.LogCursor read in the instant a rotation has emptied the log but not yet put its
copy in place as ``.1`` (corral.logfiles.rotate_if_over: truncate, then rename): the follower
must still send what it had not read of the old content, once, and the new content once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corral import logfiles, loglines


def test_a_read_between_truncate_and_rename_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "replica-1.log"
    old = b"".join(b"old line %04d\n" % i for i in range(100))
    log.write_bytes(old)
    cursor = loglines.LogCursor(log, 0)
    out = [cursor.read(100)[0]]
    real_replace = os.replace

    def replace(src: Path, dst: Path) -> None:
        out.append(cursor.read(100)[0])  # the log is empty, its .1 not there yet
        with open(log, "ab") as f:
            f.write(b"new line\n")
        out.append(cursor.read(100)[0])
        real_replace(src, dst)

    monkeypatch.setattr(logfiles.os, "replace", replace)
    assert logfiles.rotate_if_over(log, 10) is not None
    monkeypatch.setattr(logfiles.os, "replace", real_replace)
    while chunk := cursor.read(100)[0]:
        out.append(chunk)
    assert b"".join(out) == old + b"new line\n"


def test_a_copy_left_by_a_crash_is_not_waited_for(tmp_path: Path) -> None:
    log = tmp_path / "replica-1.log"
    log.write_bytes(b"a line\n" * 10)
    cursor = loglines.LogCursor(log, 0)
    assert cursor.read()[0] == b"a line\n" * 10
    stale = logfiles.backup_tmp_of(log)
    stale.write_bytes(b"half a copy")
    os.utime(stale, (1, 1))
    log.write_bytes(b"")  # emptied some other way
    log.write_bytes(b"fresh\n")
    assert cursor.read() == (b"fresh\n", True)


def test_a_rename_just_after_the_cursor_looked_for_one_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower reads the log in a thread while the cap rotates it. When the rename came
    after the cursor took the rotation mark but before it looked for a copy in progress, the
    cursor kept the mark from before the rename: it then took the new ``.1`` for a later
    rotation's and skipped it, losing the last lines written before the rotation (seen as
    100-line gaps in test_logs_follow's rotation test)."""
    log = tmp_path / "replica-1.log"
    read_before = b"".join(b"read line %04d\n" % i for i in range(50))
    log.write_bytes(read_before)
    cursor = loglines.LogCursor(log, 0)
    assert cursor.read()[0] == read_before
    unread = b"".join(b"unread line %04d\n" % i for i in range(50))
    with open(log, "ab") as f:
        f.write(unread)
    renames: list[tuple[Path, Path]] = []
    monkeypatch.setattr(logfiles.os, "replace", lambda src, dst: renames.append((src, dst)))
    assert logfiles.rotate_if_over(log, 10) is not None  # emptied; its copy not renamed yet
    monkeypatch.undo()
    real_mark = loglines.rotation_mark

    def mark_then_rename(path: Path) -> logfiles.RotationMark:
        mark = real_mark(path)
        while renames:
            os.replace(*renames.pop())  # the rotating thread goes on right after this look
        return mark

    monkeypatch.setattr(loglines, "rotation_mark", mark_then_rename)
    out = []
    while chunk := cursor.read(100)[0]:
        out.append(chunk)
    assert b"".join(out) == unread
