"""nginx and HAProxy as reference proxies for bench/balancer.py: install, configure, start, stop.

Both run in the foreground as children of the benchmark, each with its own config, pid and logs
under a temporary directory, listening on 127.0.0.1 only; they are stopped by their own pid, never
through a system service. Both are configured the way one would put them in front of keep-alive
HTTP/1.1 replicas: round robin over the same replicas as corral, upstream connections kept open
and reused, responses not buffered (so a token stream passes through as it comes).

* nginx: ``worker_processes N`` (master + N workers), ``keepalive 64`` upstream,
  ``proxy_buffering off`` on ``/sse``.
* HAProxy: one process, ``nbthread N``, ``http-reuse always``, ``mode http``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


def http_ok(port: int, path: str = "/") -> bool:
    """One ``GET`` on a fresh connection answers ``200`` with the replicas' ``ok`` body."""
    with socket.create_connection((HOST, port), timeout=2) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok")


def stop_pid(
    pid: int, popen: subprocess.Popen[str] | None = None, sig: int = signal.SIGTERM
) -> None:
    """Stop one process by pid: the signal, then SIGKILL after 5 s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if popen is not None:
            if popen.poll() is not None:
                return
        elif not psutil.pid_exists(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(5)


# ---------------------------------------------------------------------------- installing


def find_binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )


def apt_install(package: str, log: Callable[[str], None]) -> bool:
    """``apt-get install -y`` one package, without letting its scripts start a system service.

    ``RUNLEVEL=1`` makes Debian's invoke-rc.d skip starting the daemon a package installs (the
    haproxy and nginx packages would otherwise start one on port 80 where init allows it).
    """
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", package]
    log(f"running: {' '.join(cmd)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"  failed: {exc}")
        return False
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        log(f"  exit {proc.returncode}: {' '.join(tail)}")
    return proc.returncode == 0


# tool -> Debian packages that provide it, tried in order
PACKAGES = {"wrk": ["wrk"], "nginx": ["nginx-light", "nginx"], "haproxy": ["haproxy"]}


def ensure_tools(log: Callable[[str], None]) -> dict[str, str | None]:
    """Paths of wrk, nginx and haproxy, installing the Debian packages that are missing."""
    found = {tool: find_binary(tool) for tool in PACKAGES}
    if all(found.values()):
        return found
    if shutil.which("apt-get") is None:
        log(f"apt-get not found: cannot install {[t for t, p in found.items() if not p]}")
        return found
    updated = False
    for tool, candidates in PACKAGES.items():
        if found[tool]:
            continue
        for package in candidates:
            ok = apt_install(package, log)
            if not ok and not updated:
                log("running: apt-get update (once)")
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    subprocess.run(["apt-get", "update"], capture_output=True, timeout=300)
                updated = True
                ok = apt_install(package, log)
            if ok:
                break
        found[tool] = find_binary(tool)
        if not found[tool]:
            log(f"{tool} could not be installed: its rows will be skipped")
    return found


def tool_version(cmd: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        out = (proc.stdout + proc.stderr).strip().splitlines()
        return out[0] if out else ""
    return ""


# ---------------------------------------------------------------------------- running


@dataclass
class Peer:
    """A running reference proxy: the process this script started, and where it listens."""

    name: str
    popen: subprocess.Popen[str]
    port: int
    stop_signal: int

    @property
    def pid(self) -> int:
        """The process to charge CPU to (its children included) and to stop.

        Both run in the foreground (``daemon off`` / ``-db``), so this is nginx's master or
        HAProxy's only process: the child this script started, nothing else is ever signalled.
        """
        return self.popen.pid

    def stop(self) -> None:
        stop_pid(self.popen.pid, self.popen, self.stop_signal)


def _wait_up(peer: Peer, log_file: Path, timeout: float = 10.0) -> Peer:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if peer.popen.poll() is not None:
            errors = log_file.read_text()[-500:] if log_file.exists() else ""
            raise RuntimeError(f"{peer.name} exited {peer.popen.returncode}: {errors.strip()}")
        with contextlib.suppress(OSError):
            if http_ok(peer.port):
                return peer
        time.sleep(0.05)
    peer.stop()
    raise RuntimeError(f"{peer.name} did not answer within {timeout:g} s")


NGINX_CONF = """\
{user}worker_processes {workers};
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 1000000;
    upstream replicas {{
        {servers}{balance}
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
        location /sse {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


# What each proxy calls least_load. nginx's least_conn counts each worker's connections alone
# unless the upstream has a shared memory zone; HAProxy's threads share their counts.
NGINX_LEAST = "\n        least_conn;\n        zone replicas 64k;"


def start_nginx(
    binary: str,
    prefix: Path,
    replica_ports: list[int],
    workers: int,
    name: str = "nginx",
    policy: str = "round_robin",
) -> Peer:
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            user="user root;\n" if os.geteuid() == 0 else "",
            workers=workers,
            prefix=prefix,
            host=HOST,
            port=port,
            servers="\n        ".join(f"server {HOST}:{p};" for p in replica_ports),
            balance=NGINX_LEAST if policy == "least_load" else "",
        )
    )
    base = [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise RuntimeError(f"nginx -t failed: {check.stderr.strip()}")
    popen = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    # SIGQUIT: nginx's graceful stop
    return _wait_up(Peer(name, popen, port, signal.SIGQUIT), prefix / "error.log")


HAPROXY_CONF = """\
global
    nbthread {threads}
    maxconn 8192
    pidfile {prefix}/haproxy.pid

defaults
    mode http
    maxconn 8192
    http-reuse always
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout http-request 10s

frontend fe
    bind {host}:{port}
    use_backend streams if {{ path_beg /sse }}
    default_backend replicas

backend replicas
    balance {balance}
    {servers}

# what nginx's proxy_buffering off is to a stream: without http-no-delay HAProxy sends the
# first chunk of a response still in progress with MSG_MORE, and the kernel holds it ~200 ms
backend streams
    balance {balance}
    option http-no-delay
    {servers}
"""


def start_haproxy(
    binary: str,
    prefix: Path,
    replica_ports: list[int],
    threads: int,
    name: str = "haproxy",
    policy: str = "round_robin",
) -> Peer:
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "haproxy.cfg"
    conf.write_text(
        HAPROXY_CONF.format(
            threads=threads,
            balance="leastconn" if policy == "least_load" else "roundrobin",
            prefix=prefix,
            host=HOST,
            port=port,
            servers="\n    ".join(
                f"server r{i + 1} {HOST}:{p}" for i, p in enumerate(replica_ports)
            ),
        )
    )
    check = subprocess.run(
        [binary, "-c", "-f", str(conf)], capture_output=True, text=True, timeout=30
    )
    if check.returncode != 0:
        raise RuntimeError(f"haproxy -c failed: {(check.stdout + check.stderr).strip()}")
    log_file = prefix / "haproxy.out"
    with log_file.open("w") as out:
        # -db: foreground, no daemon, no master-worker: one process, this child
        popen = subprocess.Popen(
            [binary, "-db", "-f", str(conf)], stdout=out, stderr=subprocess.STDOUT, text=True
        )
    # SIGTERM: HAProxy's immediate stop (SIGUSR1 would wait for idle keep-alive streams)
    return _wait_up(Peer(name, popen, port, signal.SIGTERM), log_file)
