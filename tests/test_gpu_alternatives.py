"""A GPU asked through SkyPilot's ``resources.any_of`` / ``ordered`` is placed as the same ask
under ``resources.accelerators`` is: any one of the alternatives, or refused where none can
fit. It was kept as a where-to-run note, so the replica ran with no GPU at all."""

from __future__ import annotations

import pytest

from corral.spec import SpecError, parse_spec

HEAD = "run: python3 -m http.server $PORT\nservice:\n  readiness_probe: /\n  replicas: 1\n"


def test_the_alternatives_gpus_are_the_replicas_ask_in_order() -> None:
    ordered = parse_spec(
        HEAD + "resources:\n  ordered:\n    - accelerators: V100\n    - {accelerators: {T4: 2}}\n"
    )
    assert ordered.resources.accelerators == ["V100:1", "T4:2"]
    note = next(w for w in ordered.warnings if w.startswith("resources.ordered"))
    assert "asked as alternatives (any one of V100:1, T4:2)" in note, note
    # An alternative without its own takes the base's (SkyPilot's override) ...
    inherited = parse_spec(
        HEAD + "resources:\n  accelerators: A100\n  any_of:\n    - accelerators: H100\n"
        "    - zone: us-east1-a\n"
    )
    assert inherited.resources.accelerators == ["H100:1", "A100:1"]
    # ... and one that asks no GPU at all means the replica needs none.
    optional = parse_spec(HEAD + "resources:\n  any_of:\n    - accelerators: H100\n    - cpus: 4\n")
    assert optional.resources.accelerators == []
    assert "resources.any_of: has no meaning" in " ".join(optional.warnings)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("3", "expected a list of resource mappings, one per alternative, got 3"),
        ("[]", "got an empty list"),
        ("[{accelerators: [1]}]", "alternative 1's accelerators: expected an accelerator"),
    ],
)
def test_malformed_alternatives_name_the_field(value: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(HEAD + f"resources:\n  any_of: {value}\n")
    (issue,) = caught.value.issues
    assert issue.loc == "resources.any_of" and words in issue.message, issue


def test_a_container_image_is_refused_not_run_on_the_host() -> None:
    """`image_id: docker:IMAGE` makes SkyPilot run the commands inside that image; kept as a
    note, corral ran them on the host instead. A VM image stays a where-to-run note."""
    with pytest.raises(SpecError) as caught:
        parse_spec(HEAD + "resources:\n  image_id: docker:vllm/vllm-openai:latest\n")
    (issue,) = caught.value.issues
    assert issue.loc == "resources.image_id", issue
    assert "runs each replica inside that container image" in issue.message, issue
    vm = parse_spec(HEAD + "resources:\n  image_id: projects/deeplearning-platform/img\n")
    assert "resources.image_id: has no meaning" in " ".join(vm.warnings)
