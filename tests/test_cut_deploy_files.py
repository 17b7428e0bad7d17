"""The files of a version a killed daemon made but never stored (corral.deploy_files).

A version's directory (its workdir copy and ``values.json``, 0600, with the secrets) is made
before its row is stored. A daemon killed in between left it for good: under a service that
was never created (an `up` cut), or numbered past the last stored version (an `update` cut),
secrets of a request that never happened included. The next daemon sweeps them at its start,
and never a stored version's files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import CorralHome, spec_text, write_spec

from corral import versionfiles
from corral.state import Store

# The real daemon, dying (as SIGKILL: no cleanup) when it stores ARGV[2]'s request: the
# version's files are made, the service's row or its new version is not.
DIES_STORING = """
import asyncio, os, sys
from pathlib import Path
from corral import state
from corral.bootstrap import serve

def die(*args, **kwargs):
    os._exit(137)

setattr(state.Store, sys.argv[2], die)
asyncio.run(serve(Path(sys.argv[1])))
"""

SECRET = "s3cret-of-a-cut-up"


def _cut(home: CorralHome, method: str, *args: str) -> None:
    """``corral ARGS`` against a daemon that dies in ``Store.method``."""
    home.start_daemon(argv=[sys.executable, "-c", DIES_STORING, str(home.path), method])
    result = home.run(*args, check=False)
    assert result.returncode != 0, result
    home._reap()


def _secret_files(home: CorralHome) -> list[Path]:
    return [
        path
        for path in (home.path / "services").rglob(versionfiles.VALUES_FILE)
        if SECRET in path.read_text()
    ]


def test_files_of_a_cut_up_or_update_are_swept_at_the_next_start(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    text = spec_text("cut", 1, extra="secrets:\n  TOKEN: null\n")
    spec = write_spec(tmp_path / "svc.yaml", text)
    _cut(corral_home, "create_service", "up", str(spec), "--secret", f"TOKEN={SECRET}", "-d")
    assert _secret_files(corral_home), "the cut up made no files: the test cuts it too early"
    corral_home.start_daemon()
    assert _secret_files(corral_home) == []
    assert corral_home.service("cut") is None

    corral_home.run("up", str(spec), "--secret", "TOKEN=kept", "-d")
    corral_home.stop_daemon()
    args = ("update", "cut", str(spec), "--secret", f"TOKEN={SECRET}", "-d")
    _cut(corral_home, "add_version", *args)
    assert _secret_files(corral_home), "the cut update made no files"
    corral_home.start_daemon()
    assert _secret_files(corral_home) == []
    versions = corral_home.path / "services" / "cut" / "versions"
    assert sorted(p.name for p in versions.iterdir()) == ["1"]  # the stored one stays
    assert "kept" in (versions / "1" / versionfiles.VALUES_FILE).read_text()


def test_the_sweep_keeps_every_stored_version_and_the_logs(tmp_path: Path) -> None:
    from corral.deploy_files import sweep_leftovers  # here: the test above runs without it

    home = tmp_path
    store = Store(home / "state.db")
    store.create_service("web", "name: web", source=None, base_dir=None, lb_port=None)
    for name, version in (("web", 1), ("web", 2), ("ghost", 1)):
        versionfiles.prepare_version(
            home, name, version, workdir=None, envs={}, secrets={"K": f"{name}{version}"}
        )
    (versionfiles.version_dir(home, "web", 3).parent / ".3.tmp-abcd").mkdir()
    held = versionfiles.held_dir(home, "web") / "0"
    held.mkdir(parents=True)  # files a live replica still runs in: not the sweep's to judge
    logs = home / "services" / "ghost" / "logs"
    logs.mkdir()
    (logs / "controller.log").write_text("what the ghost's namesake did\n")

    assert sweep_leftovers(home, store) == ["ghost/1", "web/2", "web/3"]
    assert sorted(p.name for p in (home / "services" / "web" / "versions").iterdir()) == ["1"]
    assert held.is_dir() and (logs / "controller.log").is_file()
    assert not (home / "services" / "ghost" / "versions").exists() or not any(
        (home / "services" / "ghost" / "versions").iterdir()
    )
    assert sweep_leftovers(home, store) == []


def test_a_refused_store_leaves_no_files(tmp_path: Path) -> None:
    """The state file refused the new service or version (locked by another process: 503,
    "nothing was changed, retry"): its files, secrets included, went nowhere until the next
    daemon's sweep. They go with the refusal."""
    import asyncio
    from unittest import mock

    import pytest

    from corral.daemon import Daemon, UpdateRequest
    from corral.infra.local import LocalInfra
    from corral.spec import parse_spec
    from corral.state import StateBusy

    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "state.db")
    deps = mock.MagicMock(capacity=None, infras={"local": LocalInfra()})
    daemon = Daemon(home, store, deps)
    text = spec_text("locked", 1, extra="secrets:\n  TOKEN: null\n")
    busy = StateBusy("state database is locked by another process; nothing was changed, retry")

    async def create() -> None:
        await daemon.create(
            text, name=None, source=None, base_dir=str(tmp_path), secrets={"TOKEN": SECRET}
        )

    with mock.patch.object(store, "create_service", side_effect=busy), pytest.raises(StateBusy):
        asyncio.run(create())
    assert _secret_files_in(home) == []

    versionfiles.prepare_version(home, "kept", 1, workdir=None, envs={}, secrets={"K": "v"})
    store.create_service("kept", text, source=None, base_dir=str(tmp_path), lb_port=None)
    daemon.controllers["kept"] = controller = mock.MagicMock()
    controller.spec.return_value = parse_spec(text, source="<test>", name="kept")
    request = UpdateRequest(spec_text=text, base_dir=str(tmp_path), secrets={"TOKEN": SECRET})
    with mock.patch.object(store, "add_version", side_effect=busy), pytest.raises(StateBusy):
        asyncio.run(daemon.update("kept", request))
    assert _secret_files_in(home) == []
    assert sorted(p.name for p in (home / "services" / "kept" / "versions").iterdir()) == ["1"]


def _secret_files_in(home: Path) -> list[Path]:
    services = home / "services"
    return [p for p in services.rglob(versionfiles.VALUES_FILE) if SECRET in p.read_text()]
