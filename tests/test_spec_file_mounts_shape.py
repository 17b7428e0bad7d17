"""``file_mounts`` is a mapping of destination to source, as in SkyPilot, on every infra.

``file_mounts: 0`` (or ``false``, ``""``, a list, a number) was accepted without a word: on
infra local the mounts check skipped any falsy value, and elsewhere the field is only kept, so
a spec meant to mount something ran without it and validate said "valid".
"""

import pytest

from corral.spec import SpecError, parse_spec

HEAD = "service:\n  readiness_probe: /\nrun: python3 -m http.server $PORT\n"


@pytest.mark.parametrize("value", ["0", "false", "''", "[a, b]", "/data", "7"])
@pytest.mark.parametrize("infra", ["local", "ray"])
def test_file_mounts_that_is_no_mapping_is_refused(value: str, infra: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(f"{HEAD}infra: {infra}\nfile_mounts: {value}\n", "svc.yaml")
    [issue] = caught.value.issues
    assert (issue.loc, issue.line) == ("file_mounts", 5)
    assert "mapping of destination" in issue.message


def test_a_source_that_is_no_path_nor_storage_is_refused() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(f"{HEAD}file_mounts:\n  /data: 5\n", "svc.yaml")
    [issue] = caught.value.issues
    assert issue.loc == "file_mounts" and "'/data'" in issue.message


@pytest.mark.parametrize("value", ["", "{}", "{data: ./data}", "{/d: {source: s3://b}}"])
def test_a_mapping_or_nothing_is_read(value: str) -> None:
    parse_spec(f"{HEAD}infra: ray\nfile_mounts: {value}\n", "svc.yaml")
