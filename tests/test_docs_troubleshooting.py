"""docs/troubleshooting.md quotes corral's own lines: each line of its `text` blocks is made
here by the code that prints it (numbers aside: an example's port or pid is its own), or, where
only a running daemon prints it, matched against the string in src/ that makes it. A message
changed without the page fails here, and so does a line quoted with no check of its own.
"""

from __future__ import annotations

import ast
import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from click.testing import CliRunner

from corral import cli_nodaemon, model_engines, plan, servicecore
from corral.admission import check_spec
from corral.capacity import fit_problem, replica_env
from corral.cli import _up_hint, _update_hint, main
from corral.cli_nodaemon import RESPAWN_NOTE
from corral.client import ClientError
from corral.cliview import service_notes, status_text
from corral.dashboard import session
from corral.dataplane import shared_ports, worker
from corral.errors import Unrunnable
from corral.infra._ray_link import RayLink
from corral.infra.base import Liveness
from corral.infra.inventory import Gpu, Inventory
from corral.infra.placement import Claim, Holder, NoFit, ask_of, place
from corral.probe import probe
from corral.spec import parse_spec

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "troubleshooting.md"
SRC = REPO / "src" / "corral"
GiB = 1024**3
# What an example's values may differ in: numbers (ports, pids, seconds, addresses).
NUMBER = re.compile(r"\d+(?:\.\d+)*")
# A %-format placeholder of a log line, read as `{}` like an f-string's.
PERCENT = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdfgr]")
NVML_MISSING = "this machine (GPUs: NVML unavailable (NVML Shared Library Not Found))"


def quoted() -> list[str]:
    """The lines of the page's `text` blocks: what it says corral prints."""
    lines, inside = [], False
    for line in DOC.read_text().splitlines():
        if line.strip().startswith("```"):
            inside = not inside and line.strip() == "```text"
        elif inside and line.strip():
            lines.append(line.strip())
    return lines


@cache
def templates() -> frozenset[str]:
    """Every string of src/ as written, each f-string value (and %-format field) as `{}`:
    adjacent literals are one string, as Python joins them."""
    found: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                found.add(
                    "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
                found.add(PERCENT.sub("{}", node.value))
    return frozenset(found)


def same(shown: str, made: str) -> bool:
    return NUMBER.sub("N", shown) == NUMBER.sub("N", made)


def holds(shown: str, made: str) -> bool:
    return NUMBER.sub("N", made) in NUMBER.sub("N", shown)


def from_source(line: str, *written: str) -> None:
    """Each of ``written`` is a string of src/ (values as `{}`) and is found in ``line``."""
    for template in written:
        assert template in templates(), f"no string in src/ reads {template!r}"
        pattern = ".*?".join(re.escape(piece) for piece in template.split("{}"))
        assert re.search(pattern, line), f"{line!r} does not read as {template!r}"


def error_line(line: str) -> str:
    """What a failing command printed after `error: ` (corral.cli_common.fail, whose markup
    a terminal shows as colour)."""
    assert "[red]error:[/red] {}" in templates()
    assert line.startswith("error: "), line
    return line.removeprefix("error: ")


# -- what the code makes ------------------------------------------------------------------------


def refused_probe() -> str:
    """What a readiness probe says of a port nobody listens on, asked for real."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def once() -> str | None:
        async with aiohttp.ClientSession() as http:
            result = await probe(http, f"http://127.0.0.1:{port}", path="/health", timeout=5)
        return result.error

    error = asyncio.run(once())
    assert error is not None
    return error


class _Core:
    """What ``ServiceCore.mark_gone`` uses of its service: its name, a replica's log, and
    where the failure goes."""

    name: str

    def __init__(self, name: str, log: Path) -> None:
        self.name, self.log, self.failures = name, log, list[str]()

    def replica_log(self, replica_id: int) -> Path:
        return self.log

    def mark_failed(self, r: object, kind: object, failure: str, **kw: object) -> None:
        self.failures.append(failure)


def exit_failure(tmp_path: Path, name: str, code: int, log: str, detail: str = "") -> str:
    """The failure of replica 1 of ``name`` whose process exited with ``code``, its log
    ending in ``log``: as a running daemon's probe records it."""
    path = tmp_path / "replica_1.log"
    path.write_text(f"starting\n{log}\n")
    core = _Core(name, path)
    infra = SimpleNamespace(exit_code=lambda handle: code)
    r = SimpleNamespace(id=7, seq=1)
    servicecore.ServiceCore.mark_gone(core, r, infra, None, Liveness.EXITED, detail)  # type: ignore[arg-type]
    assert len(core.failures) == 1
    return core.failures[0]


def validate_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> str:
    """`corral validate NAME` of a spec holding ``text``, run in the spec's directory."""
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["--home", str(tmp_path / "home"), "validate", name])
    assert result.exit_code == 1, result.output
    return result.stderr


def _pending(line: str) -> None:
    machine = Inventory(
        gpus=(
            Gpu(0, "NVIDIA A100-SXM4-80GB", "GPU-a0", 80 * GiB),
            Gpu(1, "NVIDIA A100-SXM4-80GB", "GPU-a1", 80 * GiB),
        ),
        cpus=8,
        memory=64 * GiB,
    )
    holders = [
        Holder("svc-a", 11, Claim(gpus={"GPU-a0": 1.0}), number=1),
        Holder("svc-a", 12, Claim(gpus={"GPU-a1": 1.0}), number=2),
    ]
    outcome = place(ask_of({"accelerators": ["A100:1"]}), machine, holders)
    assert isinstance(outcome, NoFit)
    service = {"name": "svc-d", "replicas": [{"id": 5, "waiting": outcome.reason}]}
    assert [text for _, text in service_notes(service)] == [line]


def _starting_refused(line: str) -> None:
    replica = {
        "status": "STARTING",
        "starting_seconds": 8.0,
        "initial_delay_seconds": 30.0,
        "last_probe": refused_probe(),
    }
    assert same(line, status_text(replica)), status_text(replica)


def _starting_503(line: str) -> None:
    from_source(line, "HTTP {}")
    replica = {
        "status": "STARTING",
        "starting_seconds": 130.0,
        "initial_delay_seconds": 1200.0,
        "last_probe": "HTTP 503",
    }
    assert line == status_text(replica), status_text(replica)


def _initial_delay(line: str) -> None:
    from_source(line, "not ready within {}s: {}")
    assert holds(line, refused_probe()), line


def _hopeless(tmp_path: Path, line: str) -> None:
    shell = "/usr/bin/bash: line 1: pyhton3: command not found"
    failure = exit_failure(tmp_path, "typo", 127, shell)
    if line.startswith("error: "):
        from_source(
            error_line(line),
            "service {} is {}: {}{}",
            "version {} never became ready and {} replica{} failed; last: replica {} {}: {}",
        )
        assert line.endswith(f"FAILED: {failure}"), (line, failure)
    else:
        assert line == failure, failure


def _port_in_use(tmp_path: Path, line: str) -> None:
    from_source(line, ": its port {} is in use by {}", "pid {} ({})")
    detail = ": its port 18932 is in use by pid 5478 (python3)"
    assert same(line, exit_failure(tmp_path, "fixed", 1, "OSError: [Errno 98]", detail))


def _endpoint_taken(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from_source(line, "pid {} ({})")
    monkeypatch.setattr(shared_ports, "socket_owner", lambda inode: "pid 7001 (nginx)")
    problem = shared_ports.describe(44209, [("127.0.0.1", 4242)])
    service = {"name": "svc", "replicas": [], "balancer_errors": [problem]}
    assert [text for _, text in service_notes(service)] == [line]


def _fixed_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    text = "run: python3 -m http.server 8080\nresources: {ports: 8080}\nservice: {replicas: 2}\n"
    said = validate_says(tmp_path, monkeypatch, "vl.yaml", text)
    assert f"vl.yaml:1: {line}" in said.splitlines(), said


def _colon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    text = 'name: x\nrun: echo "a: b"\nservice: {replicas: 1}\n'
    said = validate_says(tmp_path, monkeypatch, "a.yaml", text)
    assert line in said.splitlines(), said


def _typo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    text = "run: x\nservice:\n  replicas: 1\n  replica_polcy: {}\n"
    said = validate_says(tmp_path, monkeypatch, "t.yaml", text)
    assert f"t.yaml:4: {line}" in said.splitlines(), said


def _no_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str) -> None:
    """`up` refuses it before any daemon is asked (none is started for it)."""
    (tmp_path / "s.yaml").write_text(
        "name: s\nrun: x $PORT\nenvs:\n  HF_TOKEN:\nservice: {replicas: 1}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    result = CliRunner().invoke(main, ["--home", str(tmp_path / "home"), "up", "s.yaml"])
    assert result.exit_code == 1
    assert f"s.yaml:4: {line}" in result.stderr.splitlines(), result.stderr
    assert not (tmp_path / "home" / "daemon.json").exists()


def _no_gpu(line: str) -> None:
    from_source(line, "this machine (GPUs: {})", "NVML unavailable ({})")
    spec = parse_spec("run: x\nresources: {accelerators: A100:1}\n")
    machine = Inventory(gpus=(), cpus=2, memory=8 * GiB, source=NVML_MISSING)
    problem = fit_problem(spec.resources.model_dump(exclude_none=True), machine)
    assert problem is not None and error_line(line) == problem, problem


def _hidden_gpus(line: str) -> None:
    machine = Inventory(gpus=(Gpu(0, "NVIDIA L4", "GPU-l0", 24 * GiB),), cpus=2, memory=GiB)
    env = replica_env(Claim(), machine)
    assert line == " ".join(f"{k}={v}" for k, v in env.items()), env


def _model_first(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal as this machine makes it, its interpreter and cache path read as the
    example's (an engine installed here would change the reasons: then skipped)."""
    from importlib.util import find_spec

    if find_spec("vllm") or find_spec("sglang"):
        pytest.skip("an engine is installed here")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    spec = parse_spec("model: meta-llama/Llama-3.1-8B-Instruct\nservice: {replicas: 1}\n")
    with pytest.raises(model_engines.ModelUnavailable) as refused:
        model_engines.engine_command(spec)
    made = str(refused.value).replace(model_engines.sys.executable, "/usr/bin/python3")
    made = made.replace(str(tmp_path / "hf" / "hub"), "/root/.cache/huggingface/hub")
    assert error_line(line) == made, made


def _exists(line: str) -> None:
    said = error_line(line)
    from_source(said, "service {} already exists")
    hint = _update_hint(ClientError("x", status=409), "fixed", Path("fixed.yaml"))
    assert said == "service 'fixed' already exists" + hint, hint


def _missing(line: str) -> None:
    said = error_line(line)
    from_source(said, "no service named {}")
    hint = _up_hint(ClientError("x", status=404), "nosuch", Path("fixed.yaml"))
    assert said == "no service named 'nosuch'" + hint, hint


def _ray_missing(line: str) -> None:
    spec_text = "name: r\ninfra: ray\nrun: x $PORT\n"
    with pytest.raises(Unrunnable) as refused:
        check_spec(spec_text, source=None, name=None, infras={"local": object()}, capacity=None)  # type: ignore[dict-item]
    assert error_line(line) == str(refused.value)


def _ray_unreachable(line: str) -> None:
    """A cluster that does not answer its first connection within the timeout."""
    release = threading.Event()

    def never(address: str) -> object:
        release.wait(10)
        raise ConnectionError("gone")

    link = RayLink("10.0.0.5:6379", connect_timeout=0.05, make=never)  # type: ignore[arg-type]
    link.start()
    try:
        deadline = time.monotonic() + 5
        while link.settling() and time.monotonic() < deadline:
            time.sleep(0.01)
        said = link.not_ready()
    finally:
        link.close()
        release.set()
    assert said is not None and same(line, said), said


def _dashboard(line: str) -> None:
    assert any("/login?once={}" in t for t in templates())
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/ui/login\?once=\S+", line), line


# Each quoted line (found by a piece of it) and its check.
Check = Callable[[str, Path, pytest.MonkeyPatch], None]
CHECKS: dict[str, Check] = {
    "STARTING (8s": lambda line, tmp, mp: _starting_refused(line),
    "STARTING (2m": lambda line, tmp, mp: _starting_503(line),
    "not ready within": lambda line, tmp, mp: _initial_delay(line),
    "not READY after": lambda line, tmp, mp: from_source(
        line, "service {} not READY after {}s (status {}); it keeps trying"
    ),
    "pyhton3": lambda line, tmp, mp: _hopeless(tmp, line),
    "its port 18932": lambda line, tmp, mp: _port_in_use(tmp, line),
    "not this replica's": lambda line, tmp, mp: from_source(
        line,
        "port {} is held by a process that is not this replica's ({}): the probe reached it, "
        "not the replica",
        "pid {} ({})",
    ),
    "never uses $PORT": lambda line, tmp, mp: _fixed_port(tmp, mp, line),
    "endpoint not served": lambda line, tmp, mp: _endpoint_taken(line, mp),
    "waits: needs": lambda line, tmp, mp: _pending(line),
    "launch slots busy": lambda line, tmp, mp: from_source(
        line, "{} replica {} waits: {}", "launch slots busy: all {} of the daemon's are held{} ({})"
    ),
    "needs 1x A100: the machine has no A100": lambda line, tmp, mp: _no_gpu(line),
    "CUDA_VISIBLE_DEVICES=": lambda line, tmp, mp: _hidden_gpus(line),
    "cannot run here": lambda line, tmp, mp: _model_first(line, tmp, mp),
    "`run: |`": lambda line, tmp, mp: _colon(tmp, mp, line),
    "envs.HF_TOKEN": lambda line, tmp, mp: _no_value(tmp, mp, line),
    "replica_polcy": lambda line, tmp, mp: _typo(tmp, mp, line),
    "already exists": lambda line, tmp, mp: _exists(line),
    "no service named": lambda line, tmp, mp: _missing(line),
    "stopped unexpectedly": lambda line, tmp, mp: _equal(line, RESPAWN_NOTE),
    "started one (pid": lambda line, tmp, mp: from_source(
        line, "no daemon for {}s: started one (pid {})"
    ),
    "no corral daemon runs on": lambda line, tmp, mp: from_source(
        error_line(line), "no corral daemon runs on {}: start one with `corral daemon start`"
    ),
    "orphan process(es)": lambda line, tmp, mp: from_source(
        line,
        "{} orphan process(es) of {} deleted home(s)",
        ": `corral doctor --end-orphans` ends them",
    ),
    "infra 'ray'": lambda line, tmp, mp: _ray_missing(line),
    "Ray cluster at": lambda line, tmp, mp: _ray_unreachable(line),
    "RAY_ADDRESS is set": lambda line, tmp, mp: from_source(
        line,
        "RAY_ADDRESS is set but Ray is missing ({})",
        "in corral's checkout: pip install -e '.[ray]'",
    ),
    "/ui/login?once=": lambda line, tmp, mp: _dashboard(line),
}


def _equal(line: str, made: str) -> None:
    assert line == made, made


def test_every_quoted_line_has_a_check() -> None:
    lines = quoted()
    assert len(lines) >= len(CHECKS)
    unchecked = [line for line in lines if not any(key in line for key in CHECKS)]
    assert not unchecked, f"quoted in {DOC.name} with no check here: {unchecked}"


@pytest.mark.parametrize("key", list(CHECKS))
def test_the_quoted_line_is_what_corral_prints(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [line for line in quoted() if key in line]
    assert lines, f"{key!r}: no longer quoted in {DOC.name} (drop its check)"
    for line in lines:
        CHECKS[key](line, tmp_path, monkeypatch)


def test_the_numbers_the_page_gives() -> None:
    """The defaults and limits the page states, as the code has them."""
    probe_spec = parse_spec("run: x\nservice: {replicas: 1}\n").service.readiness_probe
    assert probe_spec.initial_delay_seconds == 1200 and probe_spec.timeout_seconds == 15
    model = parse_spec("model: corral-llmsim\nservice: {replicas: 1}\n")
    assert model.service.readiness_probe.path == "/health"
    assert plan.MAX_FAILURES_BEFORE_READY == 3 and {126, 127} == plan.HOPELESS_EXIT_CODES
    assert worker.BIND_RETRY == 1.0
    assert session.CODE_SECONDS == 120
    assert cli_nodaemon.RESPAWN_NOTE in DOC.read_text()
    # The API (and so the dashboard) and the endpoints are on 127.0.0.1 unless told otherwise.
    daemon_run = main.commands["daemon"].commands["run"]  # type: ignore[attr-defined]
    host = next(p for p in daemon_run.params if p.name == "host")
    assert host.default == "127.0.0.1"
    assert "{}://127.0.0.1:{}" in templates()


def test_any_exit_quotes_the_apps_last_line(tmp_path: Path) -> None:
    """A replica that exits with a code says the app's last line, as a 127 does: "process
    exited (code 3)" alone sent the user to its log for the reason, which SkyServe's users
    meet as "failed after 3 retries". Not its launch's own lines, not after a signal."""
    said = exit_failure(tmp_path, "boom", 3, "RuntimeError: cannot load model")
    assert said.startswith("process exited (code 3: RuntimeError: cannot load model); see"), said
    quiet = exit_failure(tmp_path, "quiet", 3, "[corral] run: exit 3")
    assert quiet.startswith("process exited (code 3); see"), quiet
    killed = exit_failure(tmp_path, "killed", -9, "serving on 8080")
    assert killed.startswith("process exited (signal 9 (SIGKILL)); see"), killed
