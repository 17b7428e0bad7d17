"""`corral validate` names every resource a machine can never give, not only the first.

SkyServe's llama2 example asks `memory: 32+` and a T4: on a machine with neither, naming only
the memory sends the user back to `validate` to learn about the GPU after fixing it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from corral.cli import main
from corral.infra.inventory import Inventory
from corral.infra.placement import ask_of

GiB = 1024**3
SMALL = Inventory((), 2, 8 * GiB, cpu_ids=(0, 1), source="test: 2 cores")


def test_misfits_names_memory_and_accelerators() -> None:
    from corral.infra.placement import misfits  # new with the fix

    ask = ask_of({"memory": "64+", "accelerators": ["A100:4", "A100:8"]})
    problems = misfits(ask, SMALL)
    assert [p.field for p in problems] == ["resources.memory", "resources.accelerators"]
    # two options of one missing model: said once
    assert str(problems[1]).count("the machine has no A100") == 1, problems[1]


def validate_on_a_small_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> dict[str, str]:
    """`corral validate --json` of ``text`` on a machine of 2 CPUs, 8 GB and no GPU: its
    errors, field -> message (it must be refused)."""
    inventory = tmp_path / "small.yaml"
    inventory.write_text("gpus: []\ncpus: 2\nmemory: 8\n")
    monkeypatch.setenv("CORRAL_INVENTORY", str(inventory))
    monkeypatch.delenv("CORRAL_GPUS", raising=False)
    spec = tmp_path / "svc.yaml"
    spec.write_text(text)
    args = ["--home", str(tmp_path / "home"), "validate", "--json", str(spec)]
    document = json.loads(CliRunner().invoke(main, args).stdout)
    assert not document["valid"], document
    return {e["field"]: e["message"] for e in document["errors"]}


def test_validate_reports_every_resource_that_never_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors = validate_on_a_small_machine(
        tmp_path,
        monkeypatch,
        "service:\n  readiness_probe: /\n  replicas: 1\n"
        "resources:\n  memory: 32+\n  accelerators: T4:1\n"
        "run: python3 -m http.server $PORT\n",
    )
    assert errors["resources.memory"].startswith("needs 32 GiB"), errors
    assert errors["resources.accelerators"].startswith("needs 1x T4"), errors


def test_validate_refuses_gpu_alternatives_the_machine_has_none_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SkyPilot's `any_of` alternatives are placed as `accelerators` options are
    (tests/test_gpu_alternatives.py): refused where none can fit."""
    errors = validate_on_a_small_machine(
        tmp_path,
        monkeypatch,
        "service:\n  readiness_probe: /\n  replicas: 1\nrun: python3 -m http.server $PORT\n"
        "resources:\n  any_of:\n    - accelerators: H100\n    - accelerators: A100\n",
    )
    assert errors["resources.accelerators"].startswith("needs 1x H100 or 1x A100"), errors


def test_up_is_refused_for_every_reason_at_once() -> None:
    """The daemon's admission (what `up` and the API run) raised on the first of the model,
    the port and the fit: a spec with a fixed port and a GPU the machine lacks named only the
    port, and the GPU came out at the next `up`."""
    from types import SimpleNamespace

    from corral.admission import check_spec
    from corral.errors import Unrunnable

    spec = (
        "name: both\nservice:\n  readiness_probe: /\n  replicas: 2\n"
        "resources:\n  ports: 8081\n  accelerators: T4:1\nrun: python3 -m http.server 8081\n"
    )
    capacity = SimpleNamespace(inventory=SMALL)
    with pytest.raises(Unrunnable) as refused:
        check_spec(spec, source=None, name=None, infras={"local": object()}, capacity=capacity)  # type: ignore[dict-item,arg-type]
    said = str(refused.value)
    assert said.startswith("run: the replicas serve on port 8081"), said
    assert "resources.accelerators: needs 1x T4" in said, said
