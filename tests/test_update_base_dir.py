"""An update that changes only the `service:` section keeps the running replicas, relabelled
(:func:`corral.deploy.same_replicas`), whichever directory `corral update` is run in, when
nothing the replicas run depends on that directory.

The directory the CLI runs in (``base_dir``) resolves a spec's relative paths. Its workdir,
file mounts, env and secret values are copied into the version's files and compared by their
fingerprint; what is left is a model-first spec's relative model path, resolved into the
engine's command. Before, an update sent from another directory than the one before (a CI job,
a shell elsewhere) relaunched every replica to change a balancer knob: for an LLM service,
every engine's model load again, its KV cache lost and its streams cut at the drain.
"""

from __future__ import annotations

from pathlib import Path

from corral.deploy import prepare, same_replicas
from corral.spec import ServiceSpec, parse_spec

SPEC = (
    "name: m\n{what}\nservice:\n  replicas: 2\n  load_balancer:\n    hold_timeout_seconds: {hold}\n"
)


def _version(
    home: Path, version: int, base: Path, what: str, hold: int
) -> tuple[int, str, ServiceSpec]:
    base.mkdir(exist_ok=True)
    spec = parse_spec(SPEC.format(what=what, hold=hold), require_service=True)
    prepare(home, "m", version, spec, base_dir=str(base), envs={}, secrets={})
    return version, str(base), spec


def test_a_service_change_sent_from_another_directory_keeps_the_replicas(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for n, what in enumerate(("model: corral-llmsim", "run: exec python3 -m http.server $PORT")):
        old = _version(home, 2 * n + 1, tmp_path / "a", what, 30)
        new = _version(home, 2 * n + 2, tmp_path / "b", what, 20)
        assert same_replicas(home, "m", old, new), what


def test_what_the_directory_resolves_still_counts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    for side in ("a", "b"):
        (tmp_path / side / "app").mkdir(parents=True)
        (tmp_path / side / "app" / "main.py").write_text(f"print({side!r})\n")
    what = "run: exec python3 main.py\nworkdir: app"
    old = _version(home, 1, tmp_path / "a", what, 30)
    new = _version(home, 2, tmp_path / "b", what, 20)
    assert not same_replicas(home, "m", old, new)  # another workdir: new replicas
    # versions without files (stored by an older corral): the directory is all there is
    spec = parse_spec(SPEC.format(what="run: exec true", hold=30), require_service=True)
    assert not same_replicas(home, "m", (7, "/x", spec), (8, "/y", spec))
    assert same_replicas(home, "m", (7, "/x", spec), (8, "/x", spec))
