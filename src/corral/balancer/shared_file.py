"""A small file every balancer worker of a service maps, for what they keep in common.

The conversation table (:mod:`corral.balancer.affinity`) and the board of counts in flight
(:mod:`corral.balancer.load_board`) are both such files: created 0600 in the data plane's
directory, zero-filled to their size (zero reads as "nothing here" in both), and mapped shared,
so a write by one worker is seen by the others at once without a lock or a message.

Every page is allocated before the file is mapped (``posix_fallocate``, not a sparse file from
``ftruncate``): a write to a mapped page the filesystem cannot allocate (a full disk) is not an
error but a SIGBUS, which would end the worker and every service it serves. A full disk is an
OSError here instead, and the workers go on unshared. Where a filesystem cannot allocate ahead
(some FUSE or network ones, or a C library without the call's emulation) the file is grown
sparse as before; and on copy-on-write filesystems (btrfs, ZFS) allocated blocks still do not
promise later writes room, so there a full disk can still end a worker.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger("corral.balancer")


def map_shared(path: str | Path, size: int, what: str) -> mmap.mmap | None:
    """``path`` mapped for reading and writing, created (0600) and grown with zeros to ``size``
    bytes when it is smaller; None, logged as ``what`` not shared, when it cannot be: the
    workers then go on as if each were alone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # Zeros (racing workers agree on them), every block allocated: also for a file an
            # older version left sparse at its full size.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise  # ENOSPC above all: unshared, not a SIGBUS later
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:
        log.warning("%s %s not shared: %s", what, path, exc)
        return None
