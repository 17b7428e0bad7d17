"""A type error says what was written, never a contradiction: ``replicas: 2.0`` got "expected a
whole number, got 2", and ``any_of: [~, {...}]`` "expected a list ..., got a list"."""

import pytest

from corral.spec import SpecError, parse_spec

HEAD = "service:\n  readiness_probe: /\nrun: x $PORT\n"


def _message(text: str) -> str:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "svc.yaml")
    [issue] = caught.value.issues
    return issue.message


@pytest.mark.parametrize(
    "text",
    [
        "service:\n  readiness_probe: /\n  replicas: 2.0\nrun: x $PORT\n",
        HEAD + "num_nodes: 1.0\n",
    ],
)
def test_a_whole_float_for_a_count_is_shown_as_written(text: str) -> None:
    message = _message(text)
    assert "got 2.0" in message or "got 1.0" in message, message
    assert "decimal point" in message


@pytest.mark.parametrize("field", ["any_of", "ordered"])
def test_an_alternative_that_is_no_mapping_is_named(field: str) -> None:
    message = _message(HEAD + f"resources:\n  {field}: [{{accelerators: T4}}, ~]\n")
    assert not message.endswith("got a list"), message
    assert "alternative 2 is nothing (null)" in message, message


def test_a_whole_number_too_large_for_a_number_says_so() -> None:
    big = "9" * 400
    message = _message(
        f"service:\n  readiness_probe:\n    initial_delay_seconds: {big}\nrun: x $PORT\n"
    )
    assert "too large" in message and "400 digits" in message, message
