"""Replicas are confined away from the control plane (issue 12, item 2).

A replica runs as the daemon's user. Before confinement, one that guessed ``~/.corral/token``
read it and DELETEd another service through the API. Here a real daemon launches a replica whose
``setup`` and ``run`` try every door we know of, given the home's path as a hostile app would
guess it, and write down what they met; the test then reads that report. Also checked on the
module directly, as root and (through ``setpriv``) as an unprivileged user, since a daemon of a
normal user confines through a user namespace instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLES, CorralHome, spec_text, wait_for, write_spec

from corral.infra import confine

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(confine.landlock_abi() < 1, reason="the kernel has no Landlock"),
]

# What a hostile replica tries. It is given the home's path (hex-encoded, so that "no variable
# names the home" stays checkable) and the pids of the daemon and a balancer worker.
PROBE = r"""
import ctypes, json, os, signal, sys, urllib.request, urllib.error

home = bytes.fromhex(os.environ["GUESS"]).decode()
daemon, worker = int(os.environ["DAEMON_PID"]), int(os.environ["WORKER_PID"])
report = {"cwd": os.getcwd()}

def attempt(name, fn):
    try:
        report[name] = ["ok", repr(fn())[:300]]
    except BaseException as exc:
        report[name] = [type(exc).__name__, str(exc)[:300]]

def read(path):
    with open(path, "rb") as f:
        return f.read(64)

attempt("list_home", lambda: os.listdir(home))
attempt("read_token", lambda: read(os.path.join(home, "token")))
attempt("read_state", lambda: read(os.path.join(home, "state.db")))
attempt("read_logs", lambda: os.listdir(os.path.join(home, "services")))
attempt("daemon_root", lambda: os.listdir(f"/proc/{daemon}/root{home}"))
attempt("daemon_cwd", lambda: os.readlink(f"/proc/{daemon}/cwd"))
seen = b""
for pid in (daemon, worker):
    for name in ("environ", "maps", "cmdline", "status"):
        try:
            seen += open(f"/proc/{pid}/{name}", "rb").read()
        except OSError:
            pass
report["proc_text"] = seen.decode(errors="replace")
attempt("daemon_mem", lambda: read(f"/proc/{daemon}/mem"))
opened = []
for fd in os.listdir(f"/proc/{daemon}/fd"):  # the numbers are visible; the files must not be
    for how in (os.readlink, read):
        try:
            how(f"/proc/{daemon}/fd/{fd}")
            opened.append(f"{how.__name__} {fd}")
        except OSError:
            pass
report["daemon_fds_opened"] = opened
attempt("worker_root", lambda: os.listdir(f"/proc/{worker}/root{home}"))
attempt("signal_daemon", lambda: os.kill(daemon, 0))
attempt("signal_worker", lambda: os.kill(worker, 0))

libc = ctypes.CDLL(None, use_errno=True)
def umount():
    if libc.umount2(home.encode(), 2) != 0:  # MNT_DETACH
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return os.listdir(home)
attempt("umount_home", umount)

named = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if home.encode() in read(f"/proc/{pid}/cmdline") + b"" and pid != str(os.getpid()):
                named.append(pid)
        except OSError:
            pass
report["cmdlines_naming_home"] = named
report["env_naming_home"] = sorted(k for k, v in os.environ.items() if home in v)

def delete():
    req = urllib.request.Request(os.environ["API"] + "/v1/services/victim", method="DELETE")
    try:
        return urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
attempt("api_delete", delete)

with open(os.path.join(os.environ["OUT"], sys.argv[1] + ".json"), "w") as f:
    json.dump(report, f)
"""


def _denied(entry: list[str]) -> bool:
    return entry[0] in {"PermissionError", "FileNotFoundError", "OSError"}


def _check(report: dict[str, Any], home: Path, token: str) -> None:
    assert report["list_home"] == ["ok", "[]"], report  # an empty cover over the home
    for door in (
        "read_token",
        "read_state",
        "read_logs",
        "daemon_root",
        "daemon_cwd",
        "daemon_mem",
        "worker_root",
        "signal_daemon",
        "signal_worker",
        "umount_home",
    ):
        assert _denied(report[door]), (door, report[door])
    assert not Path(report["cwd"]).is_relative_to(home), report["cwd"]
    assert report["daemon_fds_opened"] == [], report
    assert report["cmdlines_naming_home"] == [], report
    assert report["env_naming_home"] == [], report
    assert report["api_delete"] == ["ok", "401"], report  # reachable, but not as a client
    # What /proc shows of the daemon and a worker to a root replica (their environment and maps
    # stay readable to root here; see docs/reliability.md) holds no secret.
    assert "corral" in report["proc_text"], report["proc_text"][:300]
    assert token not in report["proc_text"]
    assert token not in json.dumps(report)


def test_a_replica_cannot_reach_the_home_the_daemon_or_other_services(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    corral_home.run("up", str(write_spec(tmp_path / "victim.yaml", spec_text("victim", 1))))
    info = corral_home.api("GET", "/v1/daemon").json()
    assert info["confinement"]["confined"], info["confinement"]
    app = tmp_path / "hostile"
    app.mkdir()
    (app / "probe.py").write_text(PROBE)
    shutil.copy(EXAMPLES / "app.py", app / "app.py")
    out = tmp_path / "out"
    out.mkdir()
    envs = {
        "GUESS": str(corral_home.path.resolve()).encode().hex(),
        "DAEMON_PID": str(info["pid"]),
        "WORKER_PID": str(info["balancer_workers"][0]["pid"]),
        "API": corral_home.api_url,
        "OUT": str(out),
    }
    spec = spec_text(
        "hostile",
        1,
        workdir=app,
        setup=f"{sys.executable} probe.py setup",
        run=f"{sys.executable} probe.py run && exec {sys.executable} app.py",
        envs=envs,
    )
    corral_home.run("up", str(write_spec(tmp_path / "hostile.yaml", spec)))
    for stage in ("setup", "run"):
        report = json.loads((out / f"{stage}.json").read_text())
        _check(report, corral_home.path.resolve(), corral_home.token)
    assert corral_home.status("victim")["status"] == "READY"
    launch_log = next(corral_home.path.glob("services/hostile/logs/replica_*_launch.log"))
    assert "[corral] confined:" in launch_log.read_text()


def test_without_a_workdir_a_replica_runs_outside_the_home(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    out = tmp_path / "cwd.txt"
    run = f"pwd > {out} && cp {EXAMPLES / 'app.py'} . && exec {sys.executable} app.py"
    text = spec_text("nowhere", 1, run=run).replace(f"workdir: {EXAMPLES}\n", "")
    corral_home.run("up", str(write_spec(tmp_path / "nowhere.yaml", text)))
    cwd = Path(out.read_text().strip())
    assert not cwd.is_relative_to(corral_home.path.resolve())
    assert cwd.stat().st_uid == os.getuid()
    assert (cwd.parent.parent.parent.stat().st_mode & 0o777) == 0o700  # $TMPDIR/corral-<uid>
    corral_home.run("down", "nowhere")
    wait_for(lambda: not cwd.exists(), 30, "the scratch directory to go with the service")


# Run as the daemon would be (undumpable), plan confinement for the home (argv[1]), then start a
# child under it that lists the home, reads its token, tries the parent's environment and says
# its uid.
PARENT = """
import os, subprocess, sys
from pathlib import Path
from corral.infra import confine
from corral.limits import undumpable
undumpable()
home = Path(sys.argv[1])
plan, text = confine.plan(home)
print(text)
assert plan is not None, text
child = (
    "import os, sys\\n"
    "home, parent = sys.argv[1], sys.argv[2]\\n"
    "print(os.listdir(home))\\n"
    "for label, path in (('token', os.path.join(home, 'token')),\\n"
    "                    ('environ', '/proc/%s/environ' % parent)):\\n"
    "    try:\\n"
    "        open(path, 'rb').read()\\n"
    "        print(label, 'READ')\\n"
    "    except OSError as exc:\\n"
    "        print(label, type(exc).__name__)\\n"
    "print(os.getuid())\\n"
)
done = subprocess.run([sys.executable, "-c", child, str(home), str(os.getpid())],
                      preexec_fn=plan.preexec(), capture_output=True, text=True, check=True)
print(done.stdout, end="")
"""


def _confined_listing(home: Path, python: str, user: list[str], src: Path) -> list[str]:
    """PARENT's output lines, run by ``python`` as ``user`` (a setpriv prefix, or nothing),
    with ``src`` on its path."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(src), "HOME": "/"}
    done = subprocess.run(
        [*user, python, "-c", PARENT, str(home)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_confinement_holds_as_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "token").write_text("secret")
    lines = _confined_listing(home, sys.executable, [], Path(confine.__file__).parents[2])
    assert "mount namespace" in lines[0]
    assert lines[1:3] == ["[]", "token FileNotFoundError"]
    assert lines[4] == "0"  # still root (its environ line: see the unprivileged test)


def test_the_confinement_holds_for_an_unprivileged_daemon(request: pytest.FixtureRequest) -> None:
    """A daemon of a normal user confines through a user namespace of its own; its replicas
    keep the user's uid. Run as `nobody` through setpriv, with the system's Python (the
    confinement module needs nothing outside the standard library)."""
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if os.geteuid() != 0 or setpriv is None or not os.access(python, os.X_OK):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to act as another user")
    nobody = 65534
    # Not under tmp_path: pytest's base directory is 0700, closed to `nobody`.
    base = Path(tempfile.mkdtemp(prefix="corral-confine-"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    base.chmod(0o755)
    home = base / "home"
    home.mkdir(mode=0o700)
    (home / "token").write_text("secret")
    os.chown(home, nobody, nobody)
    os.chown(home / "token", nobody, nobody)
    # The two modules it needs (standard library only), where `nobody` can read them: the
    # checkout may sit in a directory closed to other users.
    package = base / "src" / "corral"
    (package / "infra").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "infra" / "__init__.py").write_text("")
    shutil.copy(confine.__file__, package / "infra" / "confine.py")
    shutil.copy(Path(confine.__file__).parents[1] / "limits.py", package / "limits.py")
    for path in [base / "src", package, package / "infra", *package.rglob("*.py")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    user = [setpriv, f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"]
    lines = _confined_listing(home, python, user, base / "src")
    assert "user namespace" in lines[0]
    # And the daemon's environment (it names the home) is closed to it: not dumpable.
    assert lines[1:] == ["[]", "token FileNotFoundError", "environ PermissionError", str(nobody)]
