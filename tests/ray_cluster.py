"""A private multi-node Ray cluster on this machine, for corral's Ray tests and benchmark.

Why a helper process owns the cluster (``python tests/ray_cluster.py serve DIR``): the
tests run under ``pytest -n 2``, whose scheduler spreads one module's tests over both workers,
so a fixture in each worker would start one cluster per worker. The first user starts the
helper, later users (other workers) attach to the same one, and the last to detach shuts it
down. The helper holds the ``ray.cluster_utils.Cluster`` and its handles, so the cluster is shut
down by ``Cluster.shutdown()`` and by pid (never ``ray stop``, which kills every Ray process on
the machine by name), and the helper stops it on its own when every user process is gone (a
killed test run leaves nothing).

Everything is private to ``DIR``: ``RAY_TMPDIR`` (sessions, sockets, logs) and the address file;
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every process on 127.0.0.1. Users talk to the
helper through files: ``info.json`` (address, nodes, pids), ``users/<pid>`` (who is attached),
``cmd/<id>.json`` -> ``cmd/<id>.out`` (add or remove a node, list named actors, shut down).

Use :class:`LocalRayCluster`: ``attach()`` (starting the helper if needed), ``add_node``,
``remove_node``, ``detach()``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["LocalRayCluster", "cluster_env"]

_POLL = 0.1


def cluster_env(directory: Path) -> dict[str, str]:
    """What a process needs in its environment to use the cluster kept in ``directory``."""
    return {
        "RAY_TMPDIR": str(directory / "ray"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
    except OSError:
        return True


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``. The last user deletes the whole directory, lock file
    included, so a lock won on a file that was unlinked meanwhile is dropped and taken again."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                if os.fstat(f.fileno()).st_ino != os.stat(path).st_ino:
                    continue
            except FileNotFoundError:
                continue
            try:
                yield
                return
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class LocalRayCluster:
    """A handle on the helper-owned cluster in ``directory`` (see the module docstring).

    ``nodes`` describes the cluster when this handle is the one that starts it: one dict of
    ``Cluster.add_node`` arguments per node, the first being the head.
    """

    def __init__(self, directory: Path, nodes: list[dict[str, Any]]) -> None:
        self.dir = Path(directory)
        self.nodes = nodes
        self.info: dict[str, Any] = {}
        self._attached = False

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def env(self) -> dict[str, str]:
        return cluster_env(self.dir)

    def node_id(self, resource: str) -> str:
        """The id of the (first live) node that has custom resource ``resource``."""
        self.refresh()
        for node in self.info["nodes"]:
            if resource in node["resources"] and node["alive"]:
                return str(node["node_id"])
        raise KeyError(f"no live node has resource {resource!r}")

    def refresh(self) -> dict[str, Any]:
        self.info = json.loads((self.dir / "info.json").read_text())
        return self.info

    def attach(self, timeout: float = 120.0) -> LocalRayCluster:
        """Use the cluster, starting the helper (and so the cluster) when none runs."""
        with _locked(self.dir / "lock"):
            (self.dir / "users").mkdir(exist_ok=True)
            (self.dir / "cmd").mkdir(exist_ok=True)
            (self.dir / "users" / str(os.getpid())).touch()
            self._attached = True
            if not self._server_alive():
                self._start_server(timeout)
        self.refresh()
        return self

    def _server_alive(self) -> bool:
        try:
            info = json.loads((self.dir / "info.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(info.get("ready")) and _alive(int(info["server_pid"]))

    def _start_server(self, timeout: float) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / "info.json").unlink()
        (self.dir / "nodes.json").write_text(json.dumps(self.nodes))
        env = dict(os.environ) | self.env
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - handed to the child
        with log:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "serve", str(self.dir)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the Ray cluster helper exited with {proc.returncode}: {self._log_tail()}"
                )
            if self._server_alive():
                return
            time.sleep(_POLL)
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"the Ray cluster did not start within {timeout:g}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return (self.dir / "server.log").read_text(errors="replace")[-3000:]
        except OSError as exc:
            return repr(exc)

    def command(self, op: str, timeout: float = 120.0, **args: Any) -> Any:
        """Ask the helper to do ``op`` (``add_node``, ``remove_node``, ``shutdown``)."""
        cid = uuid.uuid4().hex
        _write_json(self.dir / "cmd" / f"{cid}.json", {"op": op, "args": args})
        out = self.dir / "cmd" / f"{cid}.out"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if out.exists():
                answer = json.loads(out.read_text())
                out.unlink()
                if "error" in answer:
                    raise RuntimeError(f"cluster {op} failed: {answer['error']}")
                self.refresh()
                return answer.get("result")
            if not self._server_alive() and op != "shutdown":
                raise RuntimeError(f"the Ray cluster helper is gone: {self._log_tail()}")
            time.sleep(_POLL)
        raise TimeoutError(f"cluster {op} did not finish within {timeout:g}s")

    def add_node(self, timeout: float = 120.0, **node_args: Any) -> str:
        """Start one more node; its node id."""
        return str(self.command("add_node", timeout, **node_args))

    def remove_node(self, node_id: str, timeout: float = 60.0) -> None:
        self.command("remove_node", timeout, node_id=node_id)

    def named_actors(self, prefix: str = "") -> list[str]:
        """Names of the cluster's live named actors (any namespace) that start with ``prefix``."""
        listed = self.command("named_actors", 60.0)
        return sorted(a["name"] for a in listed if str(a["name"]).startswith(prefix))

    def detach(self, timeout: float = 120.0) -> list[int]:
        """Stop using the cluster; the last user shuts it down and deletes its directory.
        Returns pids of the cluster that survived the shutdown (killed by pid; empty when the
        shutdown was clean)."""
        if not self._attached:
            return []
        self._attached = False
        with _locked(self.dir / "lock"):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / "users" / str(os.getpid())).unlink()
            users = [p for p in (self.dir / "users").iterdir() if _alive(int(p.name))]
            if users or not self._server_alive():
                return []
            server = int(self.info["server_pid"])
            survivors: list[int] = list(self.command("shutdown", timeout) or [])
            deadline = time.monotonic() + 30.0
            while _alive(server) and time.monotonic() < deadline:
                time.sleep(_POLL)
            if _alive(server):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server, signal.SIGKILL)
                survivors.append(server)
            shutil.rmtree(self.dir, ignore_errors=True)
            return survivors


# -- the helper process ---------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    """Pids of every live descendant of ``pid`` (from /proc; ppid chains)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {p for p in found if _alive(p)}


def _node_pids(node: Any) -> list[int]:
    pids = []
    for infos in node.all_processes.values():
        for info in infos:
            pids.append(int(info.process.pid))
    return pids


def _serve(directory: Path) -> int:
    """The helper: start the cluster, answer commands, shut down when asked or orphaned."""
    import ray
    from ray.cluster_utils import Cluster

    nodes: list[dict[str, Any]] = json.loads((directory / "nodes.json").read_text())
    head_args = {"include_dashboard": False, **nodes[0]}
    cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=False)
    head: Any = cluster.head_node
    by_id: dict[str, Any] = {head.node_id: head}
    specs: dict[str, Mapping[str, Any]] = {head.node_id: nodes[0]}
    for args in nodes[1:]:
        node = cluster.add_node(**args)
        by_id[node.node_id] = node
        specs[node.node_id] = args
    cluster.wait_for_nodes(timeout=120)
    removed: set[str] = set()
    stopping = False

    def on_term(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)

    def publish() -> None:
        _write_json(
            directory / "info.json",
            {
                "ready": True,
                "server_pid": os.getpid(),
                "address": cluster.address,
                "nodes": [
                    {
                        "node_id": nid,
                        "head": node is cluster.head_node,
                        "alive": nid not in removed,
                        "resources": dict(specs[nid].get("resources") or {}),
                        "labels": dict(specs[nid].get("labels") or {}),
                        "pids": [] if nid in removed else _node_pids(node),
                    }
                    for nid, node in by_id.items()
                ],
            },
        )

    publish()
    print(f"cluster up at {cluster.address} with {len(by_id)} nodes", flush=True)
    users = directory / "users"
    idle_since: float | None = None
    while not stopping:
        for cmd in sorted((directory / "cmd").glob("*.json")):
            request = json.loads(cmd.read_text())
            cmd.unlink()
            answer: dict[str, Any] = {}
            try:
                op, args = request["op"], request.get("args") or {}
                if op == "add_node":
                    node = cluster.add_node(**args)
                    by_id[node.node_id] = node
                    specs[node.node_id] = args
                    cluster.wait_for_nodes(timeout=120)
                    answer["result"] = node.node_id
                elif op == "remove_node":
                    cluster.remove_node(by_id[args["node_id"]])
                    removed.add(args["node_id"])
                elif op == "named_actors":
                    # The helper connects as a driver only when asked (tests checking for
                    # leaked actors): their own process may already be connected elsewhere.
                    if not ray.is_initialized():
                        ray.init(address=cluster.address, log_to_driver=False)
                    answer["result"] = ray.util.list_named_actors(all_namespaces=True)
                elif op == "shutdown":
                    stopping = True
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:
                answer["error"] = repr(exc)
            publish()
            if stopping:
                if ray.is_initialized():
                    ray.shutdown()  # before the GCS goes: a driver left behind would wait for it
                answer["result"] = _shutdown(cluster)
            _write_json(cmd.with_suffix(".out"), answer)
        # Orphaned (every user process gone without detaching): do not outlive the test run.
        live = [p for p in users.iterdir() if p.name.isdigit() and _alive(int(p.name))]
        if live:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > 10.0:
            print("every user is gone; shutting down", flush=True)
            stopping = True
        time.sleep(_POLL)
    if ray.is_initialized():
        ray.shutdown()
    if cluster.head_node is not None:
        _shutdown(cluster)
    _write_json(directory / "info.json", {"ready": False, "server_pid": os.getpid()})
    return 0


def _shutdown(cluster: Any) -> list[int]:
    """``cluster.shutdown()``, then SIGKILL by pid whatever of the cluster survived it (worker
    processes included: they are the raylets' children). Returns the survivors' pids."""
    before = _descendants(os.getpid())
    with contextlib.suppress(Exception):
        cluster.shutdown()
    deadline = time.monotonic() + 20.0
    left = {p for p in before if _alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(_POLL)
        left = {p for p in left if _alive(p)}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    print(f"cluster shut down; {len(left)} process(es) needed SIGKILL: {sorted(left)}", flush=True)
    return sorted(left)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "serve":
        return _serve(Path(argv[1]))
    print("usage: python tests/ray_cluster.py serve DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
