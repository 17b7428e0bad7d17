"""SpecError.behind: the spec without the fields its issues refuse, which `validate` checks
further and takes the warnings of (corral.spec.behind). Nothing is made up for a refused
field: it is left out, or its section when a field it needs is missing."""

import pickle

import pytest

from corral.spec import SpecError, parse_spec

RUN = "run: python3 -m http.server $PORT\n"


def _behind(text: str) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "svc.yaml")
    return caught.value


def test_a_missing_max_replicas_leaves_the_policy_at_min_replicas() -> None:
    error = _behind(
        "service:\n  replica_policy:\n    min_replicas: 3\n    target_qps_per_replica: 2\n"
        "    spot_placer: dynamic\n" + RUN + "resources:\n  use_spot: true\n"
    )
    assert error.behind is not None
    policy = error.behind.service.replica_policy
    assert (policy.min_replicas, policy.max_replicas, policy.autoscaling) == (3, 3, False)
    assert any(w.startswith("resources.use_spot") for w in error.behind.warnings)
    assert any("spot_placer" in w for w in error.behind.warnings)
    assert error.behind.line_of("run") == 6


@pytest.mark.parametrize(
    "text",
    [
        "service:\n  readiness_probe: /\n  replicas: many\n  ~: 1\n" + RUN,
        "service:\n  readiness_probe: not a path\n" + RUN,
        "service:\n  autoscaling:\n    metrics: [{type: qps, target: 1}, {type: x, target: 1}]\n"
        + RUN,
        "service:\n  tls: {keyfile: k}\n" + RUN + "envs:\n  bad name: 1\n",
    ],
)
def test_refused_fields_are_left_out_and_the_rest_parsed(text: str) -> None:
    error = _behind(text)
    assert error.behind is not None, error
    assert error.behind.run == "python3 -m http.server $PORT"


@pytest.mark.parametrize("text", ["run: [a]\n", "service: {readiness_probe: /}\n"])
def test_nothing_is_behind_a_refused_or_missing_run(text: str) -> None:
    assert _behind(text).behind is None


def test_problems_found_after_a_valid_parse_carry_the_spec() -> None:
    error = _behind("service:\n  ports: 9000\n" + RUN + "resources:\n  ports: 8000\n")
    assert error.behind is not None and error.behind.service.ports == 9000


def test_the_error_still_pickles() -> None:
    error = pickle.loads(pickle.dumps(_behind("run: [a]\n")))
    assert error.issues[0].loc == "run"


def test_a_date_key_is_left_out_too() -> None:
    error = _behind("service:\n  readiness_probe: /\n  replicas: 2\n  2024-01-01: x\n" + RUN)
    assert error.behind is not None  # the key alone, not the section with it
    assert error.behind.service.replica_policy.min_replicas == 2


def test_nothing_is_checked_behind_a_refused_infra() -> None:
    # Read as the default, local, a `infra: rya` spec would be judged by local rules (a fixed
    # port, this machine's GPUs) that its backend does not have.
    error = _behind("infra: rya\nservice:\n  readiness_probe: /\n  replicas: 2\nrun: x\n")
    assert error.behind is None


def test_thousands_of_unknown_keys_are_not_each_located(monkeypatch: pytest.MonkeyPatch) -> None:
    # The spec behind the errors learns the lines of its own fields only: locating every key
    # of a generated file (each a walk of every key) took seconds, on the daemon's loop too.
    import corral.spec.loader as loader

    calls = []
    real = loader.locate
    monkeypatch.setattr(loader, "locate", lambda *a: calls.append(a) or real(*a))
    text = RUN + "".join(f"k{i}: 1\n" for i in range(2000))
    assert _behind(text).behind is not None
    assert len(calls) < 300, len(calls)  # the 100 issues shown, and the spec's fields
