"""A key of ``envs``/``secrets`` left without a value ("give it at up") is still checked as a
name: ``bad name:``, ``1X:`` or a null key (``? ~``) was taken as a value to give at `up`,
`validate` said "valid" and the warning asked for ``--env bad name=VALUE``, ``--env None=...``.
"""

import pytest

from corral.spec import SpecError, parse_spec

HEAD = "service:\n  readiness_probe: /\nrun: x $PORT\n"


@pytest.mark.parametrize("section", ["envs", "secrets"])
@pytest.mark.parametrize(("key", "words"), [("bad name", "not a valid"), ("1X", "not a valid"),
                                            ("? ~", "nothing (null)")])  # fmt: skip
def test_an_unset_key_that_is_no_name_is_refused(section: str, key: str, words: str) -> None:
    entry = key if key.startswith("?") else f"{key}:"
    with pytest.raises(SpecError) as caught:
        parse_spec(f"{HEAD}{section}:\n  {entry}\n", "svc.yaml")
    [issue] = caught.value.issues
    assert issue.line == 5 and issue.loc.startswith(f"{section}."), issue
    assert words in issue.message


def test_an_unset_valid_name_is_still_given_at_up() -> None:
    spec = parse_spec(f"{HEAD}envs:\n  HF_TOKEN:\nsecrets:\n  KEY:\n")
    assert spec.unset_values() == {"envs.HF_TOKEN": 5, "secrets.KEY": 7}
