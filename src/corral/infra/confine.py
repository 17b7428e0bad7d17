"""Keep local replicas away from the control plane that runs them.

A replica runs as the daemon's user, so without more it could read ``$CORRAL_HOME/token`` and
then drive the daemon's API: delete other services, or run commands through a spec of its own.
Each local replica (its ``setup`` too) therefore starts in a sandbox made of two Linux
mechanisms, set up by ``preexec_fn`` between fork and exec, before any of the replica's code:

* **A mount namespace** in which the home is covered by an empty, read-only tmpfs: the token,
  the state file, the data plane's socket and every service's logs do not exist for it. A
  daemon running as root makes the namespace itself; any other user gets one inside a user
  namespace of its own that maps only its own uid and gid (so file ownership and permissions
  mean what they meant). Mounts made by the host later still reach the replica (MS_SLAVE);
  the cover never reaches the host.
* **A Landlock domain** of the replica's own, which is what makes the cover hold: a process in
  it cannot mount or unmount anything (so not lift the cover), cannot ptrace or open
  ``/proc/<pid>/{root,cwd,fd/N,mem}`` of any process outside its domain (the daemon, the
  balancer workers, other replicas: the back doors into the host's mount namespace and into
  their memory), cannot create device nodes, and (Landlock ABI 6+) cannot signal them.

What it does not do, said in docs/reliability.md: the API's TCP port stays reachable (every call
but ``/v1/health`` needs the token, which the replica cannot read); the home's path shows up in
what any process can see (``/proc/net/unix`` lists the data plane's socket; the replica's own
log is a file there; a root daemon's environment); a replica of a root daemon keeps root's
other powers (raw block devices, kernel modules), so a hard boundary against a hostile app
needs a non-root daemon.

:func:`plan` tries the whole sandbox once in a throw-away child at daemon start and says why
when it cannot be had; replicas then run unconfined and the daemon says so loudly.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corral.limits import PR_SET_DUMPABLE, libc

__all__ = ["Confinement", "landlock_abi", "plan"]

# <linux/sched.h>, <sys/mount.h>, <linux/landlock.h>. The three Landlock system calls have the
# same numbers on every architecture (they are newer than the unified syscall table).
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_RELATIME = 1 << 21
MS_SLAVE = 1 << 19
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
ACCESS_FS_MAKE_CHAR = 1 << 6
ACCESS_FS_MAKE_BLOCK = 1 << 11
SCOPE_SIGNAL = 1 << 1
# An error the child reports through ``subprocess`` (which shows the preexec_fn failed).
_FAILED = "corral could not confine the replica"


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    try:
        version = libc().syscall(
            ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
            None,
            ctypes.c_size_t(0),
            ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
        )
    except (OSError, AttributeError):
        return 0
    return max(0, int(version))


@dataclass(frozen=True)
class Confinement:
    """How replicas of one home are confined on this machine."""

    hidden: Path  # the home: covered for the replica
    userns: bool  # not root: the mount namespace lives in a user namespace of its own
    abi: int  # Landlock ABI version (>= 1)

    def describe(self) -> str:
        how = "a user namespace" if self.userns else "a mount namespace"
        signals = ", no signals to them" if self.abi >= 6 else ""
        return (
            f"replicas run in {how} where {self.hidden} is empty, under Landlock (ABI {self.abi}):"
            f" no mounts, no access to other processes' /proc entries{signals}"
        )

    def preexec(
        self, bind: tuple[Path, Path] | None = None, scratch: Path | None = None
    ) -> Callable[[], None]:
        """The ``preexec_fn`` that confines the child. Everything it needs (the C library, the
        strings, the ruleset structure) is made here, in the parent: the child only makes
        system calls, and takes no lock a thread of the parent could hold across the fork.

        ``bind`` (a directory inside the home, a directory outside it): the first is shown at
        the second before the home is covered, and the child starts there. This is how a
        replica sees its version's files (corral.versionfiles) and nothing else of the home.
        Those files are shared with other versions, so they are never written: with
        ``scratch`` (a directory of the replica's own) the view is an overlay whose writes go
        to ``scratch`` (copy-on-write: the replica may write to its working directory, as on
        a SkyPilot replica); where the kernel refuses an overlay, a read-only bind mount."""
        c = libc()
        syscall, unshare, mount, prctl = c.syscall, c.unshare, c.mount, c.prctl
        target = os.fsencode(self.hidden)
        uid, gid = os.getuid(), os.getgid()
        uid_map = f"{uid} {uid} 1\n".encode()
        gid_map = f"{gid} {gid} 1\n".encode()
        ruleset = _ruleset(self.abi)
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
        userns = self.userns
        source = target_dir = None
        remount = 0
        overlays: list[bytes] = []
        if bind is not None:
            source, target_dir = os.fsencode(bind[0]), os.fsencode(bind[1])
            # A remount in a user namespace must keep the flags the mount already has.
            remount = MS_REMOUNT | MS_BIND | MS_RDONLY | _kept_flags(bind[0])
            overlays = _overlay_options(bind[0], scratch, userns)

        def confine() -> None:
            if unshare(CLONE_NEWNS | (CLONE_NEWUSER if userns else 0)) != 0:
                _fail("unshare")
            if userns:
                # A child of an undumpable daemon (corral.limits.undumpable) is undumpable until
                # exec, and then its /proc/self files are root's: it could not write its maps.
                prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
                _write_file("/proc/self/setgroups", b"deny")
                _write_file("/proc/self/uid_map", uid_map)
                _write_file("/proc/self/gid_map", gid_map)
            if mount(None, b"/", None, MS_REC | MS_SLAVE, None) != 0:
                _fail("making mounts private")
            if source is not None and not any(
                mount(b"overlay", target_dir, b"overlay", 0, opts) == 0 for opts in overlays
            ):
                if mount(source, target_dir, None, MS_BIND | MS_REC, None) != 0:
                    _fail("showing the version's files")
                if mount(None, target_dir, None, remount, None) != 0:
                    _fail("making the version's files read-only")
            if mount(b"corral-hidden", target, b"tmpfs", flags, b"size=4k,mode=0555") != 0:
                _fail(f"covering {self.hidden}")
            if target_dir is not None:
                os.chdir(target_dir)  # the cwd set before this was the directory under the mount
            _restrict_self(syscall, ruleset)

        return confine


def _ruleset(abi: int) -> tuple[_RulesetAttr, int]:
    """The Landlock ruleset for this ABI (device nodes, and signals from ABI 6), and its size."""
    attr = _RulesetAttr(
        handled_access_fs=ACCESS_FS_MAKE_CHAR | ACCESS_FS_MAKE_BLOCK,
        handled_access_net=0,
        scoped=SCOPE_SIGNAL if abi >= 6 else 0,
    )
    # ABI 1-3 know only the first field, 4-5 the first two; a larger size is refused.
    return attr, 8 if abi < 4 else 16 if abi < 6 else 24


def _overlay_options(lower: Path, scratch: Path | None, userns: bool) -> list[bytes]:
    """Mount options to try, in order, for a copy-on-write view of ``lower`` whose writes go to
    ``scratch``; none when there is no scratch or a path would not survive the option syntax
    (the caller then binds ``lower`` read-only). Made in the parent, before the fork."""
    if scratch is None or any(c in str(p) for p in (lower, scratch) for c in ",:\\"):
        return []
    (scratch / "upper").mkdir(parents=True, exist_ok=True)
    (scratch / "work").mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={scratch}/upper,workdir={scratch}/work"
    # Unprivileged overlays keep their bookkeeping in user.* attributes.
    tries = [options + ",userxattr", options] if userns else [options]
    return [os.fsencode(t) for t in tries]


def _restrict_self(syscall: Callable[..., int], ruleset: tuple[_RulesetAttr, int]) -> None:
    """In the child, last: put it and everything it starts under the Landlock ruleset."""
    attr, size = ruleset
    fd = syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET),
        ctypes.byref(attr),
        ctypes.c_size_t(size),
        ctypes.c_uint32(0),
    )
    if fd < 0:
        _fail("landlock_create_ruleset")
    try:
        if syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), fd, ctypes.c_uint32(0)):
            _fail("landlock_restrict_self")
    finally:
        os.close(fd)


def _fail(step: str) -> None:
    """In the child: raise the errno of the failed step (reported to the parent by subprocess)."""
    code = ctypes.get_errno()
    raise OSError(code, f"{_FAILED}: {step}: {os.strerror(code)}")


def _write_file(path: str, data: bytes) -> None:
    """In the child: one unbuffered write to a /proc file (the id maps take one write)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _kept_flags(path: Path) -> int:
    """The mount flags of the filesystem holding ``path`` that a remount must repeat."""
    have = os.statvfs(path).f_flag
    pairs = (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    )
    return sum(mount_flag for st_flag, mount_flag in pairs if have & st_flag)


def plan(home: Path) -> tuple[Confinement | None, str]:
    """The confinement this machine allows for ``home``'s replicas, tried once for real on a
    throw-away child, and what it covers; or None and why there is none."""
    if os.environ.get("CORRAL_CONFINE", "auto") == "off":
        return None, "turned off (CORRAL_CONFINE=off)"
    hidden = home.resolve()
    if hidden == Path(hidden.anchor):
        return None, f"the home {hidden} is the root directory"
    abi = landlock_abi()
    if abi < 1:
        return None, "the kernel has no Landlock (Linux 5.13+ with landlock in the LSM list)"
    confinement = Confinement(hidden=hidden, userns=os.geteuid() != 0, abi=abi)
    # In a child of its own, which confines itself and reports: an exception in a preexec_fn
    # reaches the parent only as "Exception occurred in preexec_fn", without its reason.
    args = [str(hidden), "1" if confinement.userns else "0", str(abi)]
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the confinement test did not run: {exc}"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        if confinement.userns and "unshare" in reason:
            reason += " (are unprivileged user namespaces disabled?)"
        return None, reason
    return confinement, confinement.describe()


def _selftest(hidden: str, userns: str, abi: str) -> None:
    """Confine this process as a replica would be, then check the home really is empty."""
    Confinement(hidden=Path(hidden), userns=userns == "1", abi=int(abi)).preexec()()
    if os.listdir(hidden):
        sys.exit(f"{_FAILED}: {hidden} is still visible")
    try:
        os.stat(f"/proc/{os.getppid()}/root/")
    except PermissionError:
        return
    sys.exit(f"{_FAILED}: the parent's /proc/<pid>/root is still open to the replica")


if __name__ == "__main__":
    _selftest(*sys.argv[1:4])
