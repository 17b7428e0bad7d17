"""Every SkyServe example on a small machine (2 cores, 8 GiB, no GPU): it runs with the replica
count it asks for, or it is refused before launch with the reason.

Nearly every example asks ``cpus: 2+``, which SkyPilot reads as a VM size. Here CPUs are a
share (docs/gpus.md): those replicas are placed side by side, unpinned, however many cores they
ask, and `validate` warns what they get. What a machine can never give (a GPU it has not, more
memory than it has) is refused by `validate`, naming the resource. The real `corral validate`
runs in this process (27 interpreters would take minutes on a loaded machine), and the
placement function the daemon uses places each example's replicas one after the other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from conftest import SKYSERVE_EXAMPLES, skyserve_example_files

from corral.cli import main
from corral.infra.inventory import Inventory
from corral.infra.placement import Claim, Holder, ask_of, misfits, place
from corral.spec import Resources, SpecError, load_spec

EXAMPLES = SKYSERVE_EXAMPLES
GiB = 1024**3
PLACED = ("cpus", "memory", "accelerators", "cpu_pinning")
SMALL = Inventory((), 2, 8 * GiB, cpu_ids=(0, 1), source="test: 2 cores")


def asked(path: Path) -> tuple[dict[str, Any], int]:
    """The example's resources and the most replicas it asks for. From the spec when it parses;
    from its YAML otherwise (it is refused for another field, but its asks are still read)."""
    try:
        spec = load_spec(path)
    except SpecError as exc:
        if exc.behind is not None:  # what `validate` checks: the rest, as the spec says it
            resources = exc.behind.resources.model_dump(exclude_none=True)
            return resources, exc.behind.service.replica_policy.max_replicas
        raw = yaml.safe_load(path.read_text())
        wanted = {k: v for k, v in (raw.get("resources") or {}).items() if k in PLACED}
        service = raw.get("service") or {}
        policy = service.get("replica_policy") or {}
        count = service.get("replicas") or policy.get("max_replicas") or policy.get("min_replicas")
        resources = Resources.model_validate(wanted).model_dump(exclude_none=True)
        return resources, int(count or 1)
    resources = spec.resources.model_dump(exclude_none=True)
    return resources, spec.service.replica_policy.max_replicas


def placed(resources: dict[str, Any], count: int) -> list[Claim | str]:
    """Place ``count`` replicas one after the other, as the daemon does."""
    holders: list[Holder] = []
    outcomes: list[Claim | str] = []
    for n in range(count):
        outcome = place(ask_of(resources), SMALL, holders)
        if isinstance(outcome, Claim):
            holders.append(Holder("example", n, outcome))
            outcomes.append(outcome)
        else:
            outcomes.append(outcome.reason)
    return outcomes


def test_every_example_runs_its_replica_count_or_is_refused_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not EXAMPLES.is_dir():
        pytest.skip(f"shared examples not found at {EXAMPLES}")
    skyserve_example_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    inventory = tmp_path / "small.yaml"
    inventory.write_text("gpus: []\ncpus: 2\nmemory: 8\n")
    monkeypatch.setenv("CORRAL_INVENTORY", str(inventory))
    monkeypatch.delenv("CORRAL_GPUS", raising=False)
    runner = CliRunner()
    runs, refused, cpu_asks = [], [], 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        args = ["--home", str(tmp_path / "home"), "validate", "--json", str(path)]
        document = json.loads(runner.invoke(main, args).stdout)
        errors = {e["field"]: e["message"] for e in document["errors"]}
        assert all(errors.values()), (path.name, errors)  # a refusal always says why
        parsed = document["spec"] is not None
        assert not parsed or "small.yaml" in document["inventory"], document  # says which
        resources, count = asked(path)
        cpu_asks += "cpus" in resources
        problems = misfits(ask_of(resources), SMALL)
        if problems:
            for problem in problems:
                # refused before launch, naming the resource (never the CPUs: they are shared)
                assert problem.field in ("resources.accelerators", "resources.memory"), problem
                if parsed:
                    assert errors[problem.field], (path.name, errors)  # under its field
            refused.append(path.name)
            continue
        # the daemon places every replica it asks for, side by side and unpinned
        outcomes = placed(resources, count)
        assert all(isinstance(o, Claim) for o in outcomes), (path.name, outcomes)
        assert all(not o.cpu_ids for o in outcomes if isinstance(o, Claim))
        fit_fields = ("resources.accelerators", "resources.memory", "resources.cpus")
        assert not set(fit_fields) & set(errors), (path.name, errors)
        (refused if errors else runs).append(path.name)  # refused: `run`, `auth_key`...
        if not parsed:
            continue
        cpus = float(str(resources.get("cpus", "0")).rstrip("+"))
        warned = [w for w in document["warnings"] if w.startswith("resources.cpus:")]
        if count * cpus > 2:
            assert warned and f"{count} replica" in warned[0], (path.name, document["warnings"])
            assert "share them" in warned[0]
        else:
            assert not warned, (path.name, warned)
    assert len(runs) + len(refused) == 27
    assert cpu_asks >= 15  # `cpus: 2+` is in nearly every example
    assert "minimal.yaml" in runs  # cpus: 2+ on 2 cores
    assert len(runs) >= 4, runs
    assert "gorilla__gorilla.yaml" in refused  # A100:1: this machine has no GPU
    assert not (tmp_path / "home").exists()
