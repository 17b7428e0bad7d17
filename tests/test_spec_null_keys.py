"""A key YAML reads as null (``~:``, ``null:``, ``? null``) or as another non-text value
(``true:``, ``0x10:``) is an error at its own line, under the key as written.

pydantic reports such a key by the str() of its value ("None", "True", "16"), which is not what
the file says, so the error lost its line (at the top level) or took the section's line.
"""

import pytest

from corral.spec import SpecError, parse_spec

RUN = "run: python3 -m http.server $PORT\n"


def _only_issue(text: str) -> tuple[str, int | None, str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "svc.yaml")
    issues = caught.value.issues
    assert len(issues) == 1, issues
    return issues[0].loc, issues[0].line, issues[0].message


@pytest.mark.parametrize("key", ["~", "null", "Null"])
def test_a_null_key_at_the_top_is_located(key: str) -> None:
    loc, at, message = _only_issue("service:\n  readiness_probe: /\n" + RUN + f"{key}: x\n")
    assert at == 4, (loc, at, message)
    assert "nothing (null)" in message, message


def test_a_null_key_in_a_section_is_located_at_its_own_line() -> None:
    loc, at, message = _only_issue("service:\n  readiness_probe: /\n  ~: 3\n" + RUN)
    assert (loc, at) == ("service.~", 3), message
    assert "nothing (null)" in message


@pytest.mark.parametrize(("key", "shown"), [("true", "true"), ("0x10", "16")])
def test_a_typed_key_is_located(key: str, shown: str) -> None:
    loc, at, message = _only_issue(f"service:\n  readiness_probe: /\n  {key}: 3\n" + RUN)
    assert (loc, at) == (f"service.{key}", 3), message
    assert shown in message


def test_a_null_key_in_envs_is_located() -> None:
    loc, at, message = _only_issue("service: {readiness_probe: /}\n" + RUN + "envs:\n  ~: 1\n")
    assert at == 4, (loc, message)


def test_a_date_key_is_located() -> None:
    # pydantic names a date key by its repr ("datetime.date(2024, 1, 1)"), not its text.
    loc, at, message = _only_issue("service:\n  readiness_probe: /\n  2024-01-01: x\n" + RUN)
    assert (loc, at) == ("service.2024-01-01", 3), message
