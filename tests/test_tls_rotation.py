"""Certificate renewal in place: the files at the spec's paths are replaced (as certbot and
cert-manager do) and `corral update` serves the new certificate."""

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
    corral_home.run("down", "renew", "-y")
