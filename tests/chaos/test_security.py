"""Security boundaries of corral, tried against a real daemon (issue 7, "Security").

What is checked, and how:

* The API listens on 127.0.0.1 by default (the daemon's listening sockets, read with psutil),
  and every route but ``/v1/health`` answers 401 without the exact token: no header, a wrong
  token of the same length, of another length, near misses (seeded, many more in long mode), the
  token in the query string, undecodable header bytes. The guard compares in constant time: its
  code path is inspected (``hmac.compare_digest``, no ``==`` on the token).
* The token file is 0600 and the home 0700: fresh, after a restart, and when they pre-existed
  wider; an empty token file is replaced, never accepted as "Bearer ".
* A non-loopback address without TLS is refused before anything listens. With TLS the daemon
  binds 0.0.0.0 (reached here on 127.0.0.1 only), prints a warning, speaks only HTTPS, verifies
  as the certificate it recorded, and still wants the token; the CLI talks to it, also as a
  "remote" client (``CORRAL_API_URL``), and refuses a certificate that does not verify.
* The balancer of a service never reaches the daemon's API or another service, whatever the
  path, absolute-form target, Host header or CONNECT says.
* Replicas (and their setup) get no token, no ``CORRAL_*`` variable of the daemon's, and no
  inherited descriptor to the token, the state database, the lock, the log or a daemon socket.
* No code in ``src/corral`` runs a shell, except the spec's own ``run``/``setup``, and those
  are passed to ``sh -c`` as one argv item, never spliced into a larger command.

Traffic goes to 127.0.0.1 only; a wildcard bind is reached through 127.0.0.1. Test certificates
are made at test time with the ``openssl`` command.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import http.client
import inspect
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from chaos_support import record, rng, rounds
from conftest import (
    EXAMPLES,
    REPO,
    CorralHome,
    make_cert,
    needs_openssl,
    spec_text,
    wait_for,
    write_spec,
)

from corral import api
from corral.apiconn import _names_loopback
from corral.bootstrap import DaemonError, serve

pytestmark = pytest.mark.timeout(240)

SRC = REPO / "src" / "corral"

# How many checks each test ran, and which tests finished: one report line per worker at the end.
_CHECKS: dict[str, int] = {}
_STARTED: set[str] = set()


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    if _STARTED:
        lost = len(_STARTED - set(_CHECKS))  # a test that did not finish: a boundary broke
        record(
            "security",
            rounds=sum(_CHECKS.values()),
            lost=lost,
            tests=len(_STARTED),
            checks=dict(sorted(_CHECKS.items())),
        )


class Checks:
    """Counts the checks of one test; ``done()`` marks the test as passed for the report."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.n = 0
        _STARTED.add(name)

    def __call__(self, condition: object, message: object = "") -> None:
        self.n += 1
        assert condition, message

    def done(self) -> None:
        _CHECKS[self.name] = self.n


# -- helpers --------------------------------------------------------------------------------------


def request(
    port: int,
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    tls: ssl.SSLContext | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    """One request to 127.0.0.1:``port`` with the target sent verbatim (absolute-form works)
    and Host only when given in ``headers``."""
    if tls is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=timeout
        )
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=tls)
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        headers = dict(headers or {})
        headers.setdefault("Host", f"127.0.0.1:{port}")
        headers.setdefault("Connection", "close")
        if body is not None:
            headers["Content-Length"] = str(len(body))
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def client_tls(ca: Path, *, check_hostname: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = check_hostname
    return context


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def start_daemon_with(home: CorralHome, *args: str, env: dict[str, str] | None = None) -> int:
    """``corral daemon run ARGS`` in the background; waits until ``daemon.json`` names it (it
    is written once the API listens: over TLS, the fixture's plain-HTTP health check cannot
    tell) and returns its pid."""
    return home.start_daemon(40, argv=home.cli("daemon", "run", *args), env=env, answers=False)


def app_spec(directory: Path, name: str) -> Path:
    """examples/app.py (answers with its pid and the path it got) in its own workdir; setup
    writes what the setup shell inherited (environment, open descriptors) next to it."""
    work = directory / f"work-{name}"
    work.mkdir(parents=True, exist_ok=True)
    run = f"exec {sys.executable} {EXAMPLES / 'app.py'}"
    # Written by absolute path into the live directory: the replica's working directory is
    # the version's copy, whose writes stay in the replica's own overlay.
    setup = (
        f"tr '\\0' '\\n' < /proc/$$/environ > {work}/setup.env; "
        f"{{ readlink /proc/$$/fd/* || true; }} > {work}/setup.fds"
    )
    text = spec_text(name, 1, run=run, setup=setup, workdir=work)
    return write_spec(directory / f"{name}.yaml", text)


def daemon_answer(answer: Any, raw: bytes) -> bool:
    """Whether an answer looks like the daemon API's: its JSON keys, its 401, its metrics."""
    if isinstance(answer, dict):
        if answer.keys() & {"services", "stopping", "openapi", "jobs", "home", "ok"}:
            return True
        if "API token" in str(answer.get("error", "")):
            return True
    return b"# HELP" in raw or b"# TYPE" in raw


def near_misses(token: str, count: int, seed_name: str) -> list[str]:
    """Wrong tokens close to the right one: one character changed, cut short, extended."""
    r = rng(seed_name)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    out = [token[:-1], token + "x", token[1:], token.upper(), token + token, "", " " + token]
    while len(out) < count:
        i = r.randrange(len(token))
        c = r.choice(alphabet.replace(token[i], ""))
        out.append(token[:i] + c + token[i + 1 :])
    return out[:count]


# -- the guard, the shell, serve() without TLS: no daemon needed -----------------------------------


def test_guard_compares_in_constant_time() -> None:
    """The API's token check goes through hmac.compare_digest and nothing else looks at the
    token: a ``==`` would leak, through timing, how much of a guess matched."""
    check = Checks("guard")
    expected = b"Bearer " + b"t" * 43
    check(api.authorized("Bearer " + "t" * 43, expected))
    for given in ("", "Bearer ", "Bearer " + "t" * 42, "Bearer " + "t" * 44, "bearer " + "t" * 43):
        check(not api.authorized(given, expected), given)
    # aiohttp hands undecodable header bytes over as surrogates: a 401, never a 500.
    check(not api.authorized("Bearer \udcff\udcfe", expected))
    check(frozenset({"/v1/health"}) == api.OPEN_PATHS, api.OPEN_PATHS)

    tree = ast.parse(textwrap.dedent(inspect.getsource(api.authorized)))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    check("hmac.compare_digest" in calls, calls)
    guard_src = textwrap.dedent(inspect.getsource(api.make_app))
    check("authorized(" in guard_src, "the guard does not call api.authorized")
    # Nowhere in the API is the token or the expected header compared with == / != / in.
    module = ast.parse(Path(api.__file__).read_text())
    for node in ast.walk(module):
        if isinstance(node, ast.Compare):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            check(not names & {"token", "expected", "given"}, ast.unparse(node))
    check.done()


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return type(node).__name__


SPAWNERS = {
    "subprocess.Popen",
    "subprocess.run",
    "subprocess.call",
    "subprocess.check_call",
    "subprocess.check_output",
    "capture.spawn",
    "capture.run",
    "jobs.run_command",
    "run_command",
    "spawn",
    "asyncio.create_subprocess_exec",
}
FORBIDDEN = {
    "os.system",
    "os.popen",
    "subprocess.getoutput",
    "subprocess.getstatusoutput",
    "asyncio.create_subprocess_shell",
    "pty.spawn",
}

# The documented exception: the spec's `run` and `setup`, each one argv item after `-c`.
SHELL_COMMANDS = {
    ("infra/local.py", "_launch", "request.setup"),
    ("infra/local.py", "_launch", "request.run"),
    ("infra/_ray_actor.py", "_spawn", "command"),
}


def scan_shell_use(root: Path) -> tuple[list[str], set[tuple[str, str, str]], int, int]:
    """Every way code under ``root`` starts a process, judged.

    Returns (problems, shell commands as (file, function, command expression), how many "-c"
    constants the code holds, how many spawning call sites were checked). A problem is a shell
    call (os.system, create_subprocess_shell ...), ``shell=`` anything but False (or a wrapper
    handing on its own ``shell`` parameter), an argv that is not a list (or a wrapper's own
    parameter), an argv item built from pieces, or ``SHELL -c X`` where X is not one plain value
    or something follows it.
    """
    problems: list[str] = []
    shell_lists: set[tuple[str, str, str]] = set()
    dash_c = sites = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node

        def function_of(
            node: ast.AST, parents: dict[ast.AST, ast.AST] = parents
        ) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
            while node in parents:
                node = parents[node]
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    return node
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "-c":
                dash_c += 1
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            where = f"{rel}:{node.lineno} {ast.unparse(node)[:120]}"
            if name in FORBIDDEN or name.startswith(("os.exec", "os.spawn", "os.posix_spawn")):
                problems.append(f"shell or exec call: {where}")
            func = function_of(node)
            params = set()
            if func is not None:
                params = {a.arg for a in func.args.args + func.args.kwonlyargs}
            for kw in node.keywords:
                if kw.arg != "shell":
                    continue
                plain = isinstance(kw.value, ast.Constant) and kw.value.value is False
                # A wrapper's own `shell` parameter (default False) handed on: allowed.
                passed_on = isinstance(kw.value, ast.Name) and kw.value.id in params
                if not (plain or passed_on):
                    problems.append(f"shell= not False: {where}")
            if name not in SPAWNERS or not node.args:
                continue
            sites += 1
            argv = node.args[0]
            if isinstance(argv, ast.Name):
                if argv.id not in params:
                    problems.append(f"argv {argv.id} neither a list nor passed on: {where}")
                continue
            if not isinstance(argv, ast.List | ast.Tuple):
                problems.append(f"argv is not a list: {where}")
                continue
            for item in argv.elts:
                if isinstance(item, ast.JoinedStr | ast.BinOp):
                    problems.append(f"argv item built from pieces (f-string, +, %): {where}")
        # Shell argv lists wherever they are built: a spawner may get one from its caller
        # (the local backend builds `[shell, "-c", request.run]` and hands it to its starter).
        for node in ast.walk(tree):
            if not isinstance(node, ast.List | ast.Tuple):
                continue
            items = node.elts
            for i, item in enumerate(items):
                if not (isinstance(item, ast.Constant) and item.value == "-c" and i > 0):
                    continue
                if "python" in _dotted(items[0]) or "executable" in _dotted(items[0]):
                    continue  # python -c CODE is not a shell (and none exists today)
                where = f"{rel}:{node.lineno} {ast.unparse(node)[:120]}"
                if any(isinstance(x, ast.JoinedStr | ast.BinOp) for x in items):
                    problems.append(f"argv item built from pieces (f-string, +, %): {where}")
                command = items[i + 1] if i + 1 < len(items) else None
                if i != len(items) - 2 or not isinstance(command, ast.Attribute | ast.Name):
                    problems.append(f"shell command is not one plain value: {where}")
                    continue
                func = function_of(node)
                fname = func.name if func is not None else "<module>"
                shell_lists.add((rel, fname, ast.unparse(command)))
    return problems, shell_lists, dash_c, sites


def test_nothing_runs_through_a_shell_but_the_specs_run_and_setup(tmp_path: Path) -> None:
    check = Checks("no-shell")
    problems, shell_lists, dash_c, sites = scan_shell_use(SRC)
    check(sites >= 5, f"only {sites} spawning call sites found: is the scan blind?")
    check(not problems, "\n".join(problems))
    check(shell_lists == SHELL_COMMANDS, shell_lists)
    # Every "-c" in the source is one of those argv lists (none appended to a list elsewhere).
    check(dash_c == len(SHELL_COMMANDS), f"{dash_c} '-c' constants, expected {len(SHELL_COMMANDS)}")
    # The Ray actor's `command` is the spec's run/setup, handed over unchanged.
    ray_src = (SRC / "infra" / "ray.py").read_text()
    check("actor.start.remote(request.run," in ray_src, "ray: run not passed as is")
    check("self._run_setup(actor, request.setup," in ray_src, "ray: setup not passed as is")
    check("actor.run_setup.remote(command," in ray_src, "ray: setup not passed as is")
    # And the spec says they are shell.
    spec_src = "".join(p.read_text() for p in sorted((SRC / "spec").glob("*.py")))
    check("shell command" in spec_src, "the spec does not document run as a shell command")

    # The scan sees what it must refuse (else the checks above prove nothing).
    bad = {
        "system": "os.system('rm ' + name)",
        "true": "subprocess.run(c, shell=True)",
        "string": "subprocess.Popen('ls -l')",
        "fstr": "subprocess.Popen([sh, '-c', f'cd x; {r.run}'])",
        "after": "subprocess.Popen([sh, '-c', r.run, 'x'])",
        "aio": "asyncio.create_subprocess_shell(c)",
        "exec": "os.execv(p, [p])",
    }
    for label, line in bad.items():
        root = tmp_path / label
        root.mkdir()
        code = f"import asyncio, os, subprocess\ndef f(sh, r, c, p, name):\n    {line}\n"
        (root / "bad.py").write_text(code)
        found, _, _, _ = scan_shell_use(root)
        check(found, f"the scan missed {label}: {line}")
    check.done()


def test_serve_refuses_a_non_loopback_address_without_tls(tmp_path: Path) -> None:
    """The library refuses too, not only the CLI (a script may call serve() directly). It
    fails before touching the home or binding anything."""
    check = Checks("serve-refuses")
    home = tmp_path / "home"
    for host in ("0.0.0.0", "::", "example.invalid"):
        with pytest.raises(DaemonError, match="without TLS"):
            asyncio.run(serve(home, host=host, port=0))
        check(not home.exists(), "serve() touched the home before refusing")
    # A certificate naming localhost or a loopback address fits a loopback connection.
    check(_names_loopback({"subjectAltName": (("DNS", "localhost"),)}))
    check(_names_loopback({"subjectAltName": (("IP Address", "127.0.0.1"),)}))
    check(_names_loopback({"subjectAltName": (("IP Address", "0:0:0:0:0:0:0:1\n"),)}))
    check(not _names_loopback({"subjectAltName": (("DNS", "corral.invalid"),)}))
    check(not _names_loopback({"subjectAltName": (("IP Address", "10.0.0.1"),)}))
    check(not _names_loopback({"subject": ((("commonName", "localhost"),),)}))
    check.done()


# -- the API on its default address ----------------------------------------------------------------


def test_api_on_loopback_and_every_route_needs_the_token(corral_home: CorralHome) -> None:
    check = Checks("api-token")
    pid = corral_home.start_daemon()
    home = corral_home.path
    check(mode(home) == 0o700, oct(mode(home)))
    check(mode(home / "token") == 0o600, oct(mode(home / "token")))
    sockets = listening(pid)
    check(sockets, "the daemon listens on nothing")
    check(all(addr == "127.0.0.1" for addr, _ in sockets), sockets)
    info = corral_home.daemon_info()
    assert info is not None
    check(info["scheme"] == "http" and info["host"] == "127.0.0.1", info)
    port = int(info["port"])
    token = corral_home.token

    routes: list[tuple[str, str]] = [("GET", "/v1/openapi.json"), ("GET", "/nope")]
    for path, methods in api.OPENAPI["paths"].items():
        for method in methods:
            routes.append((method.upper(), path.replace("{name}", "svc")))
    routes.append(("HEAD", "/v1/services"))
    routes.append(("PUT", "/v1/services/svc"))
    check(len(routes) >= 12, routes)

    n_miss = rounds(8, 200)
    bad_headers: list[dict[str, str]] = [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer "},
        {"Authorization": f"Basic {token}"},
        {"Authorization": token},
        {"X-Api-Token": token, "Cookie": f"token={token}"},
    ]
    bad_headers += [{"Authorization": f"Bearer {t}"} for t in near_misses(token, n_miss, "api")]
    for method, path in routes:
        if path == "/v1/health":
            status, _ = request(port, method, path)
            check(status == 200, f"{method} {path} -> {status} without a token")
            continue
        for headers in bad_headers:
            status, body = request(port, method, path, headers=headers)
            check(status == 401, f"{method} {path} with {headers} -> {status} {body[:200]!r}")
        for query in (f"token={token}", f"access_token={token}", f"Authorization=Bearer%20{token}"):
            status, _ = request(port, method, f"{path}?{query}")
            check(status == 401, f"{method} {path}?{query} -> {status}")
    # Random wrong tokens on one route (many in long mode): all refused.
    for wrong in near_misses(token, rounds(20, 2000), "api-many"):
        status, _ = request(
            port, "GET", "/v1/services", headers={"Authorization": f"Bearer {wrong}"}
        )
        check(status == 401, f"near miss {wrong!r} -> {status}")

    # Undecodable bytes in the header: a 401, not a 500 (raw socket: http.client sends text).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"GET /v1/services HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Authorization: Bearer \xff\xfe" + token.encode() + b"\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    check(answer.startswith(b"HTTP/1.1 401"), answer[:200])

    # The right token opens what the wrong ones did not (the test can fail the other way).
    for path in ("/v1/services", "/v1/daemon", "/metrics", "/v1/openapi.json"):
        status, _ = request(port, "GET", path, headers={"Authorization": f"Bearer {token}"})
        check(status == 200, f"GET {path} with the token -> {status}")
    check(corral_home.healthy(), "the daemon stopped answering")
    check.done()


def test_token_file_and_home_modes_are_narrowed_and_kept(corral_home: CorralHome) -> None:
    """A home and token that pre-existed wide open are narrowed; an empty token file is
    replaced (else ``Authorization: Bearer `` would open the API); a good token survives
    restarts, narrowed again if someone widened it."""
    check = Checks("token-modes")
    home = corral_home.path
    home.mkdir(parents=True)
    home.chmod(0o755)
    (home / "token").write_text("\n")
    (home / "token").chmod(0o644)
    pid = corral_home.start_daemon()
    check(mode(home) == 0o700, oct(mode(home)))
    check(mode(home / "token") == 0o600, oct(mode(home / "token")))
    token = corral_home.token
    check(len(token) >= 32, f"empty token file not replaced: {token!r}")
    check(corral_home.api("GET", "/v1/services", token="").status == 401)
    check(corral_home.api("GET", "/v1/services").status == 200)
    check("wrote a new one" in corral_home.tail("daemon.log"), corral_home.tail("daemon.log"))

    for restart in range(rounds(2, 6)):
        corral_home.stop_daemon()
        check(not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie")
        if restart % 2 == 0:
            home.chmod(0o777)
            (home / "token").chmod(0o666)
        pid = corral_home.start_daemon()
        check(mode(home) == 0o700, f"restart {restart}: home {oct(mode(home))}")
        check(
            mode(home / "token") == 0o600, f"restart {restart}: token {oct(mode(home / 'token'))}"
        )
        check(corral_home.token == token, "a good token was replaced on restart")
        check(corral_home.api("GET", "/v1/services").status == 200)
    check("narrowed to 0600" in corral_home.tail("daemon.log", 200), "widened token not reported")
    check.done()


# -- non-loopback binding -------------------------------------------------------------------------


@needs_openssl
def test_non_loopback_needs_tls(corral_home: CorralHome, tmp_path: Path) -> None:
    check = Checks("bind-refused")
    cert, key = make_cert(tmp_path, "cert", "DNS:localhost,IP:127.0.0.1")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases: list[tuple[list[str], str]] = [
        (["--host", "0.0.0.0"], "not loopback"),
        (["--host", "0.0.0.0", "--tls-cert", str(cert)], "go together"),
        (["--host", "0.0.0.0", "--tls-key", str(key)], "go together"),
        (["--host", "0.0.0.0", "--tls-cert", str(garbage), "--tls-key", str(key)], "cannot use"),
        (["--host", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(garbage)], "cannot use"),
    ]
    for args, message in cases:
        result = corral_home.run("daemon", "run", *args, check=False, timeout=60)
        check(result.returncode != 0, f"{args} started a daemon")
        check(message in result.stderr, f"{args}: {result.stderr!r}")
        check(corral_home.daemon_info() is None, f"{args} wrote daemon.json")
    # The plain refusal says what to do.
    result = corral_home.run("daemon", "run", "--host", "0.0.0.0", check=False)
    check("--tls-cert" in result.stderr and "--tls-key" in result.stderr, result.stderr)
    check.done()


@needs_openssl
def test_tls_on_every_interface(corral_home: CorralHome, tmp_path: Path) -> None:
    """Bound to 0.0.0.0 with TLS and reached on 127.0.0.1: HTTPS only, the certificate it
    recorded, the token still required, a warning in its log; the CLI follows."""
    check = Checks("tls")
    cert, key = make_cert(tmp_path, "cert", "DNS:localhost,IP:127.0.0.1")
    other, _ = make_cert(tmp_path, "other", "DNS:localhost,IP:127.0.0.1")
    pid = start_daemon_with(
        corral_home, "--host", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(key)
    )
    info = corral_home.daemon_info()
    assert info is not None
    check(info["scheme"] == "https" and info["tls_cert"] == str(cert.resolve()), info)
    check(info["host"] == "0.0.0.0", info)
    port = int(info["port"])
    check(("0.0.0.0", port) in listening(pid), listening(pid))
    log = corral_home.tail("daemon.log", 100)
    check("WARNING" in log and "API listening on 0.0.0.0" in log, log)

    tls = client_tls(cert)
    token = corral_home.token
    auth = {"Authorization": f"Bearer {token}"}
    wait_for(lambda: request(port, "GET", "/v1/health", tls=tls)[0] == 200, 30, "https health")
    for path in ("/v1/services", "/v1/daemon", "/metrics"):
        check(request(port, "GET", path, tls=tls)[0] == 401, f"{path} without a token")
        bad = {"Authorization": f"Bearer {token[:-1]}x"}
        check(request(port, "GET", path, tls=tls, headers=bad)[0] == 401, f"{path} wrong token")
        check(request(port, "GET", path, tls=tls, headers=auth)[0] == 200, f"{path} with token")

    # Plain HTTP to the TLS port gets no API answer (and certainly not the token's routes).
    for path in ("/v1/health", "/v1/services"):
        try:
            status, body = request(port, "GET", path, headers=auth, timeout=10)
        except (OSError, http.client.HTTPException):
            status, body = 0, b""
        check(status != 200 and b"services" not in body, f"plain http {path} -> {status}")
    # A client trusting another certificate refuses the handshake.
    with pytest.raises(ssl.SSLCertVerificationError):
        request(port, "GET", "/v1/health", tls=client_tls(other))
    check(True)

    # The CLI finds the scheme and the certificate in daemon.json.
    result = corral_home.run("daemon", "status", "--json")
    check(json.loads(result.stdout)["pid"] == pid, result.stdout)
    check("no services" in corral_home.run("status").stdout)
    # ... verifies it: trusting another certificate, it refuses (and starts no second daemon).
    wrong_env = dict(corral_home.env, CORRAL_API_CA=str(other))
    result = subprocess.run(
        corral_home.cli("status"), env=wrong_env, capture_output=True, text=True, timeout=60
    )
    check(result.returncode != 0 and "did not prove" in result.stderr, result.stderr)
    check(corral_home.daemon_info() is not None and corral_home.daemon_info()["pid"] == pid)
    # ... and as a remote client: URL, token and CA from the environment, an empty home.
    remote_env = dict(corral_home.env)
    remote_env.update(
        CORRAL_HOME=str(tmp_path / "elsewhere"),
        CORRAL_API_URL=f"https://127.0.0.1:{port}",
        CORRAL_API_TOKEN=token,
        CORRAL_API_CA=str(cert),
    )
    result = subprocess.run(
        corral_home.cli("daemon", "status", "--json"),
        env=remote_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    check(result.returncode == 0 and json.loads(result.stdout)["pid"] == pid, result.stderr)
    for key_name, value, message in (
        ("CORRAL_API_TOKEN", "x" * 43, "token"),
        ("CORRAL_API_CA", str(other), "did not prove"),
        ("CORRAL_API_URL", f"http://127.0.0.1:{port}", "is not reachable"),
    ):
        env = dict(remote_env, **{key_name: value})
        result = subprocess.run(
            corral_home.cli("status"), env=env, capture_output=True, text=True, timeout=60
        )
        check(result.returncode != 0 and message in result.stderr, (key_name, result.stderr))
    check(not (tmp_path / "elsewhere").exists(), "a remote client started a local daemon")

    corral_home.stop_daemon()
    check(corral_home.daemon_info() is None, "daemon.json left behind")
    check.done()


@needs_openssl
def test_tls_on_loopback_checks_the_certificate_name(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """TLS on 127.0.0.1 works too; a certificate that names neither localhost nor a loopback
    address is refused by the CLI before the token is sent."""
    check = Checks("tls-name")
    cert, key = make_cert(tmp_path, "cert", "DNS:corral.invalid")
    start_daemon_with(
        corral_home, "--host", "127.0.0.1", "--tls-cert", str(cert), "--tls-key", str(key)
    )
    info = corral_home.daemon_info()
    assert info is not None
    check(info["scheme"] == "https", info)
    port = int(info["port"])
    tls = client_tls(cert, check_hostname=False)
    status, _ = request(port, "GET", "/v1/services", tls=tls)
    check(status == 401, status)
    log = corral_home.tail("daemon.log", 100)
    check("API listening on" not in log, "a loopback bind printed the warning")
    result = corral_home.run("status", check=False)
    check(result.returncode != 0 and "names neither localhost" in result.stderr, result.stderr)
    check.done()


# -- the balancer and the replicas ----------------------------------------------------------------


def test_balancer_and_replicas_stay_inside_their_service(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    check = Checks("balancer-replicas")
    # A token the daemon's environment also carries (as a careless user might export it), so
    # that a replica inheriting the daemon's environment would be caught.
    home = corral_home.path
    home.mkdir(parents=True)
    token = "sec-" + "k" * 20 + "-" + os.urandom(8).hex()
    fd = os.open(home / "token", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, (token + "\n").encode())
    os.close(fd)
    corral_home.env.update(
        CORRAL_API_TOKEN=token,
        CORRAL_API_CA="/nonexistent/ca.pem",
        CORRAL_DAEMON_SECRET=token,
    )
    daemon_pid = corral_home.start_daemon()
    check(corral_home.token == token)
    for name in ("sec-a", "sec-b"):
        corral_home.run("up", "-d", str(app_spec(tmp_path, name)))
    svc_a = corral_home.wait_replicas("sec-a", 1, timeout=90)
    svc_b = corral_home.wait_replicas("sec-b", 1, timeout=90)
    pid_a = int(svc_a["replicas"][0]["pid"])
    pid_b = int(svc_b["replicas"][0]["pid"])
    port_a = int(svc_a["endpoint"].rsplit(":", 1)[1])
    port_b = int(svc_b["endpoint"].rsplit(":", 1)[1])
    info = corral_home.daemon_info()
    assert info is not None
    api_port = int(info["port"])

    # Every socket the daemon (API) and its balancer workers listen on is on loopback.
    sockets = listening(daemon_pid)
    for worker in corral_home.worker_pids():
        sockets += listening(worker)
    check({port_a, port_b, api_port} <= {p for _, p in sockets}, sockets)
    check(all(addr == "127.0.0.1" for addr, _ in sockets), sockets)

    # -- through sec-a's balancer: only sec-a's replica ever answers ------------------------
    auth = {"Authorization": f"Bearer {token}"}
    daemon_hosts = [f"127.0.0.1:{api_port}", f"localhost:{api_port}"]
    other_hosts = [f"127.0.0.1:{port_b}", f"localhost:{port_b}"]
    attempts: list[tuple[str, str, dict[str, str]]] = []
    for path in ("/v1/services", "/v1/daemon", "/metrics", "/v1/openapi.json", "/v1/health"):
        attempts.append(("GET", path, dict(auth)))
        for host in daemon_hosts + other_hosts:
            attempts.append(("GET", path, {**auth, "Host": host}))
            attempts.append(("GET", f"http://{host}{path}", {**auth, "Host": host}))
            attempts.append(("GET", path, {**auth, "X-Forwarded-Host": host}))
    for target in (
        f"//127.0.0.1:{api_port}/v1/services",
        f"@127.0.0.1:{api_port}/v1/services",
        f"/..//127.0.0.1:{api_port}/v1/services",
        f"http://127.0.0.1:{port_b}/",
        f"https://127.0.0.1:{api_port}/v1/services",
        "*",
    ):
        attempts.append(("GET", target, dict(auth)))
    attempts.append(("POST", "/v1/daemon/stop", dict(auth)))
    attempts.append(("POST", f"http://127.0.0.1:{api_port}/v1/daemon/stop", dict(auth)))
    attempts.append(("DELETE", f"http://127.0.0.1:{api_port}/v1/services/sec-b", dict(auth)))
    attempts.append(("CONNECT", f"127.0.0.1:{api_port}", dict(auth)))
    attempts.append(("CONNECT", f"127.0.0.1:{port_b}", {}))

    outcomes: dict[str, list[str]] = {"app": [], "refused": [], "closed": []}
    for method, target, headers in attempts:
        body = b"{}" if method in ("POST", "DELETE") else None
        label = f"{method} {target} Host={headers.get('Host', '-')}"
        try:
            status, raw = request(port_a, method, target, headers=headers, body=body)
        except (OSError, http.client.HTTPException) as exc:
            check(True, exc)  # refused by closing the connection: nothing reached
            outcomes["closed"].append(label)
            continue
        what = f"{method} {target} {headers.get('Host', '')} -> {status} {raw[:300]!r}"
        answer: Any = None
        with contextlib.suppress(ValueError):
            answer = json.loads(raw)
        if isinstance(answer, dict) and "pid" in answer and "replica" in answer:
            check(answer["pid"] == pid_a, f"reached another process: {what}")
            check(answer["pid"] != pid_b, what)
            outcomes["app"].append(f"{label} -> {answer['path']}")
        elif status == 501 and b"Unsupported method" in raw:
            check(method in ("POST", "DELETE"), what)  # the app's http.server refused it
            outcomes["app"].append(f"{label} -> {status}")
        else:
            # Not the app: then the balancer refused it itself (its errors name the service),
            # and nothing of the daemon's answers (services, stop, metrics, 401) came through.
            check(status >= 400, f"neither the app nor refused: {what}")
            check(not daemon_answer(answer, raw), f"daemon answer through the balancer: {what}")
            check(isinstance(answer, dict) and answer.get("service") == "sec-a", what)
            outcomes["refused"].append(f"{label} -> {status}")
    # The tricks did travel: the daemon's paths, Host names and absolute URIs reached sec-a's
    # app as plain paths (so the checks above saw real proxying, not a balancer refusing all).
    reached = "\n".join(outcomes["app"])
    check(f"GET http://127.0.0.1:{api_port}/v1/services" in reached, reached)
    check(f"Host=127.0.0.1:{port_b} -> /metrics" in reached, reached)
    check(any(r.startswith("CONNECT") for r in outcomes["refused"]), outcomes)

    # The daemon is untouched: still running both services, never told to stop.
    check(corral_home.healthy(), "the daemon stopped")
    check(psutil.pid_exists(daemon_pid))
    names = sorted(s["name"] for s in corral_home.api("GET", "/v1/services").json()["services"])
    check(names == ["sec-a", "sec-b"], names)
    check(corral_home.service("sec-b")["replicas"][0]["pid"] == pid_b)

    # -- replica environment and descriptors -------------------------------------------------
    daemon_sockets = socket_inodes(daemon_pid)
    check(daemon_sockets, "the daemon has no sockets?")
    allowed_corral = {
        "CORRAL_REPLICA_ID",
        "CORRAL_SERVICE",
        "CORRAL_VERSION",
        "CORRAL_HOME_MARKER",
        "CORRAL_REPLICA_KEY",
    }
    secret_files = {str(home / f) for f in ("token", "daemon.lock", "daemon.log", "home_id")}
    secret_files |= {str(home / f"state.db{s}") for s in ("", "-wal", "-shm")}
    for name, pid in (("sec-a", pid_a), ("sec-b", pid_b)):
        proc = psutil.Process(pid)
        env = proc.environ()
        check(env.get("CORRAL_SERVICE") == name, env.get("CORRAL_SERVICE"))
        check(not set(k for k in env if k.startswith("CORRAL_")) - allowed_corral, sorted(env))
        check(all(token not in v for v in env.values()), f"{name}: token in the environment")
        check("CORRAL_HOME" not in env, f"{name}: CORRAL_HOME leaked")
        targets = fd_targets(pid)
        check(not secret_files & set(targets), f"{name} holds {secret_files & set(targets)}")
        check(
            all(not t.startswith(str(home)) or "/services/" in t for t in targets),
            f"{name}: {targets}",
        )
        check(not socket_inodes(pid) & daemon_sockets, f"{name} shares a daemon socket")
        ports = {p for _, p in listening(pid)}
        check(not ports & {api_port, port_a, port_b}, f"{name} listens on {ports}")
        # What the setup shell had (written by the spec's setup in its workdir).
        work = tmp_path / f"work-{name}"
        setup_env = (work / "setup.env").read_text()
        check(token not in setup_env, f"{name}: token in setup's environment")
        keys = {line.split("=", 1)[0] for line in setup_env.splitlines() if "=" in line}
        check(not {k for k in keys if k.startswith("CORRAL_")} - allowed_corral, sorted(keys))
        setup_fds = set((work / "setup.fds").read_text().split())
        check(not secret_files & setup_fds, f"{name} setup held {secret_files & setup_fds}")
    check.done()
