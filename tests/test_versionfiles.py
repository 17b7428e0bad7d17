"""A version's files without a daemon: what is copied, what is shared, what is left out, and the
values given on the command line."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import SKYSERVE_EXAMPLES, make_cert, needs_openssl, skyserve_example_files

from corral.cli import main
from corral.deploy import check, launch_inputs, prepare
from corral.envflags import given_values, read_env_file
from corral.infra.local_rules import local_mount_issues
from corral.spec import (
    REDACTED,
    SpecError,
    missing_values,
    parse_spec,
    path_issues,
    redact_secrets,
)
from corral.versionfiles import (
    clone_version,
    collect_garbage,
    fingerprint,
    prepare_version,
    prune_versions,
    read_values,
    remove_service_files,
    version_dir,
)

EXAMPLES = SKYSERVE_EXAMPLES


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def make(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_gitignore_rules_apply_at_every_level(tmp_path: Path) -> None:
    src = make(
        tmp_path / "src",
        {
            ".gitignore": "*.log\n/top_only.txt\n",
            "a.py": "a",
            "x.log": "x",
            "top_only.txt": "t",
            "sub/top_only.txt": "kept: the pattern is anchored at the top",
            "sub/.gitignore": "secret.txt\n",
            "sub/secret.txt": "s",
            "sub/y.log": "y",
            "other/secret.txt": "kept: sub's .gitignore does not reach here",
            ".git/info/exclude": "excluded_by_git.txt\n",
            "excluded_by_git.txt": "e",
        },
    )
    home = tmp_path / "home"
    files = prepare_version(home, "svc", 1, workdir=src, envs={}, secrets={})
    copied = tree(files.path / "workdir")
    assert "x.log" not in copied and "sub/y.log" not in copied
    assert "top_only.txt" not in copied and "sub/top_only.txt" in copied
    assert "sub/secret.txt" not in copied and "other/secret.txt" in copied
    assert "excluded_by_git.txt" not in copied and "a.py" in copied


def test_skyignore_wins_over_gitignore(tmp_path: Path) -> None:
    src = make(
        tmp_path / "src",
        {".skyignore": "data/\n", ".gitignore": "*.log\n", "x.log": "x", "data/big": "b"},
    )
    files = prepare_version(tmp_path / "home", "svc", 1, workdir=src, envs={}, secrets={})
    copied = tree(files.path / "workdir")
    assert "x.log" in copied  # .gitignore is not read when .skyignore exists (SkyPilot)
    assert "data" not in copied and "data/big" not in copied


def test_versions_share_unchanged_files_and_cannot_change_them(tmp_path: Path) -> None:
    src = make(tmp_path / "src", {"big.bin": "x" * 100_000, "app.py": "v1"})
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("app.py")
    home = tmp_path / "home"
    one = prepare_version(home, "svc", 1, workdir=src, envs={}, secrets={})
    (src / "app.py").write_text("v2")
    two = prepare_version(home, "svc", 2, workdir=src, envs={}, secrets={})
    big = [v.path / "workdir" / "big.bin" for v in (one, two)]
    assert big[0].stat().st_ino == big[1].stat().st_ino
    assert (one.path / "workdir" / "app.py").read_text() == "v1"
    assert (two.path / "workdir" / "app.py").read_text() == "v2"
    assert one.fingerprint != two.fingerprint
    assert stat.S_IMODE(big[0].stat().st_mode) == 0o444
    assert stat.S_IMODE((one.path / "workdir" / "run.sh").stat().st_mode) == 0o555
    assert os.readlink(one.path / "workdir" / "link") == "app.py"
    # Three distinct contents in the store (app.py twice, big.bin and run.sh once each).
    assert len(list((home / "store").iterdir())) == 4

    # Pruning version 1 frees only what it alone used.
    assert prune_versions(home, "svc", keep={2}) == [1]
    assert collect_garbage(home) == 1  # app.py "v1"
    assert big[1].read_text() == "x" * 100_000
    remove_service_files(home, "svc")
    assert list((home / "store").iterdir()) == []


def test_a_workdir_holding_the_home_does_not_copy_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    make(home, {"token": "t0ken"})
    make(tmp_path, {"app.py": "a"})
    files = prepare_version(home, "svc", 1, workdir=tmp_path, envs={}, secrets={})
    assert tree(files.path / "workdir") == ["app.py"]


def test_values_are_a_private_file_and_a_rollback_shares_them(tmp_path: Path) -> None:
    home = tmp_path / "home"
    prepare_version(home, "svc", 1, workdir=None, envs={"A": "1"}, secrets={"S": "x"})
    path = version_dir(home, "svc", 1) / "values.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_values(version_dir(home, "svc", 1)) == ({"A": "1"}, {"S": "x"})
    assert clone_version(home, "svc", 1, 3)
    assert read_values(version_dir(home, "svc", 3)) == ({"A": "1"}, {"S": "x"})
    assert fingerprint(home, "svc", 3) == fingerprint(home, "svc", 1)
    assert not clone_version(home, "svc", 2, 4)


def test_secret_values_are_redacted_line_for_line() -> None:
    text = (
        "run: x\nsecrets:\n  A: plain-a\n  B: 'quoted'\n  C:\n"
        "  D: |\n    multi\n    line\nenvs:\n  E: e\n"
    )
    redacted = redact_secrets(text)
    assert redacted.count("\n") == text.count("\n")
    assert redacted.splitlines()[9] == "  E: e"
    for value in ("plain-a", "quoted", "multi"):
        assert value not in redacted
    spec = parse_spec(redacted)
    assert spec.secrets == {"A": "<redacted>", "B": "<redacted>", "D": "<redacted>"}
    assert spec.envs == {"E": "e"} and REDACTED in redacted
    assert [i.loc for i in missing_values(spec)] == ["secrets.C"]
    assert missing_values(spec, secrets=["C"]) == []


def test_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text('# comment\nexport A=1\nB="two words"\nC=3 # trailing\n\nD=\n')
    assert read_env_file(env_file) == {"A": "1", "B": "two words", "C": "3", "D": ""}
    monkeypatch.setenv("FROM_SHELL", "shell-value")
    envs, secrets = given_values(["A=override", "FROM_SHELL"], [env_file], ["TOKEN=t"])
    assert envs == {
        "A": "override",
        "B": "two words",
        "C": "3",
        "D": "",
        "FROM_SHELL": "shell-value",
    }
    assert secrets == {"TOKEN": "t"}
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(click.BadParameter, match="NOT_SET_ANYWHERE is not set"):
        given_values([], [], ["NOT_SET_ANYWHERE"])
    env_file.write_text("A=1\nnot a pair\n")
    with pytest.raises(click.BadParameter, match=r"\.env:2: expected KEY=VALUE"):
        read_env_file(env_file)


def test_every_skyserve_example_validates_or_names_what_corral_cannot_honour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`corral validate FILE` (no -n) on each of the 27 real specs: valid, or every error names
    a field and says what to do. The real command, run in this process (27 interpreters would
    take minutes on a loaded machine); test_versions_e2e runs validate as a subprocess."""
    if not EXAMPLES.is_dir():
        pytest.skip(f"shared examples not found at {EXAMPLES}")
    skyserve_example_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    # A GPU server these specs were written for (validate checks the asks against the machine
    # it runs on, docs/gpus.md): this test is about the specs, not this machine's devices.
    server = tmp_path / "server.yaml"
    server.write_text("gpus: [" + ", ".join(["NVIDIA A100-SXM4-80GB"] * 4 + ["Tesla T4"] * 4))
    server.write_text(server.read_text() + "]\ncpus: 64\nmemory: 512\n")
    monkeypatch.setenv("CORRAL_INVENTORY", str(server))
    monkeypatch.delenv("CORRAL_GPUS", raising=False)
    runner = CliRunner()
    outcomes = {}
    for spec in sorted(EXAMPLES.glob("*.yaml")):
        args = ["--home", str(tmp_path / "home"), "validate", "--json", str(spec)]
        result = runner.invoke(main, args)
        document = json.loads(result.stdout)
        assert document["valid"] is (result.exit_code == 0), (spec.name, result.output)
        for error in document["errors"]:
            assert error["field"], (spec.name, error)
            assert error["message"], (spec.name, error)
        outcomes[spec.name] = sorted(e["field"] for e in document["errors"])
    assert len(outcomes) == 27
    # On a machine without those GPUs, an ask for one is refused, naming the field.
    server.write_text("gpus: [NVIDIA L4]\ncpus: 64\nmemory: 512\n")
    result = runner.invoke(main, ["validate", "--json", str(EXAMPLES / "gorilla__gorilla.yaml")])
    refused = {e["field"]: e["message"] for e in json.loads(result.stdout)["errors"]}
    gpus = refused["resources.accelerators"]
    assert "A100" in gpus and "NVIDIA L4" in gpus, refused
    assert not (tmp_path / "home").exists()
    # Those that fail do so for a field corral cannot honour here, or one SkyPilot itself no
    # longer reads (with "did you mean"); a fixed port for several replicas on one machine is
    # the common case (`run` must use $PORT).
    assert sum(1 for fields in outcomes.values() if not fields) == 5
    assert sum(1 for fields in outcomes.values() if fields == ["run"]) == 14
    assert outcomes["minimal.yaml"] == []
    assert outcomes["http_server__task.yaml"] == ["run"]
    # Every problem at once: behind the misplaced field, the absolute mount, the V100 this
    # server lacks and two replicas on one fixed port (`run`).
    assert outcomes["stable_diffusion_service.yaml"] == [
        "file_mounts./stable_diffusion",
        "resources.accelerators",
        "resources.load_balancing_policy",
        "run",
    ]
    assert outcomes["policy__spot_hedge.yaml"] == ["run", "service.replica_policy.init_replicas"]
    assert outcomes["auth-server.yaml"] == ["service.auth_key"]


def test_file_mounts_on_local_are_copied_in_or_refused(tmp_path: Path) -> None:
    make(tmp_path, {"app/server.py": "s", "models/m.bin": "m", "config.yaml": "c"})
    text = "run: x\nworkdir: app\nfile_mounts:\n  models: models\n  conf/config.yaml: config.yaml\n"
    spec = parse_spec(text)
    assert path_issues(spec, tmp_path) == [] and local_mount_issues(spec, tmp_path) == []
    files = prepare(tmp_path / "home", "svc", 1, spec, base_dir=str(tmp_path), envs={}, secrets={})
    assert tree(files.path / "workdir") == [
        "conf",
        "conf/config.yaml",
        "models",
        "models/m.bin",
        "server.py",
    ]
    refused = parse_spec(
        "run: x\nfile_mounts:\n  /data: models\n  bucket: s3://b/k\n  gone: nowhere\n"
    )
    issues = {i.loc: i for i in local_mount_issues(refused, tmp_path)}
    assert set(issues) == {"file_mounts./data", "file_mounts.bucket", "file_mounts.gone"}
    with pytest.raises(SpecError) as refusal:  # what the daemon and `corral up` apply
        check(refused, source="svc.yaml", base_dir=str(tmp_path), envs={}, secrets={})
    assert {i.loc for i in refusal.value.issues} == set(issues)
    assert issues["file_mounts./data"].line == 2
    assert "relative destination" in (issues["file_mounts./data"].hint or "")
    assert "only a local path" in issues["file_mounts.bucket"].message
    assert "does not exist" in issues["file_mounts.gone"].message


@needs_openssl
def test_tls_files_that_are_not_there_are_refused_before_the_service_exists(
    tmp_path: Path,
) -> None:
    """A missing TLS key or certificate is an error at validate/up/update, naming the field;
    it used to pass, and fail the service as CONTROLLER_FAILED with a bare FileNotFoundError."""
    (tmp_path / "tls").mkdir()
    make_cert(tmp_path / "tls", "cert", "IP:127.0.0.1")
    text = "run: x\nservice:\n  replicas: 1\n  tls:\n    keyfile: {}\n    certfile: {}\n"
    assert path_issues(parse_spec(text.format("tls/cert.key", "tls/cert.pem")), tmp_path) == []
    spec = parse_spec(text.format("tls/nokey.pem", "tls"))
    issues = {i.loc: i for i in path_issues(spec, tmp_path)}
    assert set(issues) == {"service.tls.keyfile", "service.tls.certfile"}
    assert "tls/nokey.pem does not exist" in issues["service.tls.keyfile"].message
    assert "is not a file" in issues["service.tls.certfile"].message
    assert issues["service.tls.keyfile"].line == 5  # its own line, not that of service:
    with pytest.raises(SpecError) as refusal:  # what the daemon and `corral up` apply
        check(spec, source="svc.yaml", base_dir=str(tmp_path), envs={}, secrets={})
    assert {i.loc for i in refusal.value.issues} == set(issues)
    (tmp_path / "svc.yaml").write_text(text.format(tmp_path / "gone.pem", tmp_path / "tls"))
    result = CliRunner().invoke(
        main, ["--home", str(tmp_path / "home"), "validate", "--json", str(tmp_path / "svc.yaml")]
    )
    assert result.exit_code == 1
    fields = {e["field"] for e in json.loads(result.stdout)["errors"]}
    assert fields == {"service.tls.keyfile", "service.tls.certfile"}


def test_launch_inputs_come_from_the_version_files(tmp_path: Path) -> None:
    make(tmp_path, {"app/server.py": "s"})
    home = tmp_path / "home"
    spec = parse_spec("run: x\nworkdir: app\nenvs:\n  A: spec\n  B: spec\nsecrets:\n  S: v\n")
    # A version stored before versions had files runs as it did: the live directory.
    assert launch_inputs(home, "svc", 1, spec, str(tmp_path)) == (
        tmp_path / "app",
        {"A": "spec", "B": "spec"},
    )
    prepare(home, "svc", 1, spec, base_dir=str(tmp_path), envs={"B": "flag"}, secrets={})
    workdir, env = launch_inputs(home, "svc", 1, spec, str(tmp_path))
    assert workdir == version_dir(home, "svc", 1) / "workdir"
    assert env == {"A": "spec", "B": "flag", "S": "v"}
    # Files of this version gone while the service has others: never the live directory.
    workdir, _ = launch_inputs(home, "svc", 7, spec, str(tmp_path))
    assert workdir == version_dir(home, "svc", 7) / "workdir" and not workdir.exists()


def test_a_version_half_built_by_a_killed_daemon_is_pruned_with_its_store_files(
    tmp_path: Path,
) -> None:
    """A daemon killed inside prepare_version (or clone_version) leaves ``.N.tmp-...``: its
    hard links kept their store files alive until the service went down."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "app.py").write_text("v1")
    home = tmp_path / "home"
    prepare_version(home, "svc", 1, workdir=src, envs={}, secrets={})
    (src / "app.py").write_text("v2, never stored")
    two = prepare_version(home, "svc", 2, workdir=src, envs={}, secrets={})
    versions = home / "services" / "svc" / "versions"
    two.path.rename(versions / ".2.tmp-0a1b2c3d")  # as the kill left it: never renamed
    assert prune_versions(home, "svc", keep={1}) == [2]
    assert sorted(p.name for p in versions.iterdir()) == ["1"]
    assert collect_garbage(home) == 1  # "v2, never stored"
