"""An unknown field is an error even when it is left empty (docs/spec.md: "Unknown fields are
errors"). ``key:`` with no value means "the default" for a field corral reads; for a misspelt
one (``replica_polcy:``, ``resorces:``) or a null key (``? null``) it was dropped in silence
and `validate` said "valid", hiding the typo."""

import pytest

from corral.spec import SpecError, parse_spec

RUN = "run: python3 -m http.server $PORT\n"


@pytest.mark.parametrize(
    ("text", "loc", "line", "words"),
    [
        ("service:\n  readiness_probe: /\n  replica_polcy:\n" + RUN, "service.replica_polcy", 3,
         "did you mean"),
        ("service: {readiness_probe: /}\n" + RUN + "resorces:\n", "resorces", 3, "unknown"),
        ("service:\n  readiness_probe:\n    pth:\n" + RUN, "service.readiness_probe.pth", 3,
         "did you mean"),
        ("service: {readiness_probe: /}\n" + RUN + "? null\n", "null", 3, "nothing (null)"),
        ("model: org/m\nservice:\n  replica_polcy:\n", "service.replica_polcy", 3,
         "did you mean"),
    ],
)  # fmt: skip
def test_an_empty_unknown_field_is_an_error(text: str, loc: str, line: int, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "svc.yaml")
    [issue] = caught.value.issues
    assert (issue.loc, issue.line) == (loc, line), issue
    assert words in issue.format("svc.yaml"), issue


def test_an_empty_known_field_or_alias_still_means_its_default() -> None:
    spec = parse_spec(
        "service:\n  readiness_probe:\n    endpoint_probe_interval_seconds:\n  replicas:\n"
        "  port:\n" + RUN + "resources:\n  cloud:\n"
    )
    assert spec.service.readiness_probe.period_seconds == 5
    assert spec.warnings == []
    model_first = parse_spec("model: org/m\nservice:\n  readiness_probe:\n  replicas:\n")
    assert model_first.service.readiness_probe.path == "/health"
