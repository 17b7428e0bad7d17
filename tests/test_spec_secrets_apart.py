"""A name in both ``envs`` and ``secrets`` is refused under ``secrets`` at its line: the check
ran on the whole spec and its error had neither a field nor a line ("svc.yaml: A given in
both envs and secrets"), and it hid every other problem of the spec behind it."""

import pytest

from corral.spec import SpecError, parse_spec

HEAD = "service:\n  readiness_probe: /\nrun: x $PORT\n"


def test_a_name_in_envs_and_secrets_is_located() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(HEAD + "envs:\n  A: 1\nsecrets:\n  A: 2\n", "svc.yaml")
    [issue] = caught.value.issues
    assert (issue.loc, issue.line) == ("secrets", 6), issue
    assert "both envs and secrets" in issue.message


def test_it_does_not_hide_the_other_problems() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(HEAD + "envs:\n  A: 1\nsecrets:\n  A: 2\nnum_nodes: 2\n", "svc.yaml")
    assert {i.loc for i in caught.value.issues} == {"secrets", "num_nodes"}
    assert caught.value.behind is not None
