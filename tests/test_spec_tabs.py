"""A tab where YAML wants spaces is refused at its line, with the fix: PyYAML's words ("found
character '\\t' that cannot start any token") say what, not what to do. A tab after `key:`
is refused by PyYAML (so by SkyPilot) too, though YAML 1.2 would allow it."""

import pytest

from corral.spec import SpecError, parse_spec


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("service:\n\treadiness_probe: /\nrun: x $PORT\n", 2),
        ("service:\n  readiness_probe: /\nrun: x $PORT\nenvs:\n  A:\t1\n", 5),
    ],
)
def test_a_tab_is_refused_with_the_fix(text: str, line: int) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "svc.yaml")
    [issue] = caught.value.issues
    assert issue.line == line
    assert issue.hint is not None and "spaces" in issue.hint, issue
