"""`up` and `update` say what `validate` warns about: a SkyServe user runs `corral up` as they
ran `sky serve up`, never `validate`, and fields kept without effect (`use_spot`, zones, a
cloud) were dropped in silence. An `envs:` key left empty and given with --env is not warned
about (`up` refuses one not given)."""

from __future__ import annotations

from pathlib import Path

from conftest import CorralHome, spec_text, write_spec

KEPT = "resources:\n  use_spot: true\n  cloud: gcp\nenvs:\n  HF_TOKEN:\n"


def test_up_and_update_warn_about_fields_kept_without_effect(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "spot.yaml", spec_text("spot", 1, extra=KEPT))
    up = corral_home.run("up", "-d", str(spec), "--env", "HF_TOKEN=x")
    for field in ("resources.use_spot", "resources.cloud"):
        assert f"warning: {field}: has no meaning on infra local" in up.stderr, up.stderr
    assert "HF_TOKEN" not in up.stderr, up.stderr
    update = corral_home.run("update", "spot", str(spec), "-d", "--env", "HF_TOKEN=y")
    assert "warning: resources.use_spot: has no meaning" in update.stderr, update.stderr
