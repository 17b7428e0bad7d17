"""A service's certificate over its life: renewed in place (the files at the spec's paths
replaced, as certbot and cert-manager do), then `corral update` serves the new one; each
version keeps its own copy, so the files going away does not take the service down at a
daemon restart, and a rollback serves its version's certificate again."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import CorralHome, make_cert, needs_openssl, spec_text, write_spec

pytestmark = [needs_openssl, pytest.mark.timeout(120)]


def served_certificate(endpoint: str) -> str:
    where = urlsplit(endpoint)
    assert where.scheme == "https", endpoint
    pem = ssl.get_server_certificate((str(where.hostname), int(where.port or 443)), timeout=5)
    return ssl.DER_cert_to_PEM_cert(ssl.PEM_cert_to_DER_cert(pem))


def pem_of(cert: Path) -> str:
    return ssl.DER_cert_to_PEM_cert(ssl.PEM_cert_to_DER_cert(cert.read_text()))


def test_update_serves_a_certificate_renewed_at_the_same_path(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    old_cert, old_key = make_cert(live, "site", "IP:127.0.0.1")
    new_cert, new_key = make_cert(tmp_path, "renewed", "IP:127.0.0.1")
    tls = f"  tls:\n    keyfile: {old_key}\n    certfile: {old_cert}\n"
    spec = write_spec(tmp_path / "svc.yaml", spec_text("renew", 1) + tls)
    corral_home.run("up", str(spec))
    endpoint = corral_home.status("renew")["endpoint"]
    assert served_certificate(endpoint) == pem_of(old_cert)

    shutil.copyfile(new_cert, old_cert)  # renewed where the spec points
    shutil.copyfile(new_key, old_key)
    corral_home.run("update", "renew", str(spec))
    corral_home.wait_for(
        lambda: served_certificate(endpoint) == pem_of(new_cert),
        15,
        "the renewed certificate to be served",
    )
    # Only the balancer's business: the replica that ran is the one that runs.
    replicas = corral_home.status("renew")["replicas"]
    assert [(r["id"], r["status"]) for r in replicas] == [(1, "READY")], replicas
    corral_home.run("down", "renew", "-y")


def test_each_version_serves_its_own_copy_of_the_certificate(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """The balancer loaded the TLS files from the spec's paths at every daemon start: files
    gone since (a temp directory cleaned, a renewal half written) failed the service there
    (CONTROLLER_FAILED, its port closed), and a rollback kept the newer certificate."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    cert1, key1 = make_cert(first, "site", "IP:127.0.0.1")
    cert2, key2 = make_cert(second, "site", "IP:127.0.0.1")
    base = spec_text("kept", 1)
    spec1 = write_spec(
        tmp_path / "v1.yaml", base + f"  tls:\n    keyfile: {key1}\n    certfile: {cert1}\n"
    )
    spec2 = write_spec(
        tmp_path / "v2.yaml", base + f"  tls:\n    keyfile: {key2}\n    certfile: {cert2}\n"
    )
    pem1, pem2 = pem_of(cert1), pem_of(cert2)
    corral_home.run("up", str(spec1))
    endpoint = corral_home.status("kept")["endpoint"]
    corral_home.run("update", "kept", str(spec2))
    corral_home.wait_for(
        lambda: served_certificate(endpoint) == pem2, 15, "version 2's certificate"
    )

    shutil.rmtree(first)  # both versions' files gone from where the specs point
    shutil.rmtree(second)
    corral_home.stop_daemon()
    corral_home.start_daemon()
    corral_home.wait_for(
        lambda: corral_home.status("kept")["status"] == "READY", 30, "the service ready again"
    )
    assert served_certificate(endpoint) == pem2
    corral_home.run("update", "kept", "--to-version", "1")
    corral_home.wait_for(
        lambda: served_certificate(endpoint) == pem1, 15, "version 1's certificate"
    )
    corral_home.run("down", "kept", "-y")
