"""corral's own example specs (examples/*.yaml) are what a new user copies first: each must
read without a warning of corral's, since a warning there is advice the example itself ignores
(examples/vllm.yaml autoscaled on queue_depth alone, which `validate` warns against)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
OWN_EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert {p.name for p in OWN_EXAMPLES} >= {"llm-sim.yaml", "vllm.yaml", "sglang.yaml"}


@pytest.mark.parametrize("path", OWN_EXAMPLES, ids=lambda p: p.name)
def test_own_example_reads_without_warnings(path: Path) -> None:
    spec = load_spec(path, require_service=True)
    assert spec.warnings == []
