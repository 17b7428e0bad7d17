"""A service's TLS files (`service.tls`): what the balancer could not serve with is refused at
`validate`, `up` and `update`, naming the field, before anything changes; never a prompt."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import OPENSSL, CorralHome, make_cert, needs_openssl, spec_text, write_spec

from corral.spec import path_issues
from corral.spec.loader import load_spec

pytestmark = needs_openssl


def tls_spec(tmp_path: Path, cert: Path, key: Path) -> Path:
    text = "run: x\nservice:\n  tls:\n"
    return write_spec(tmp_path / "svc.yaml", text + f"    keyfile: {key}\n    certfile: {cert}\n")


def issues_of(tmp_path: Path, cert: Path, key: Path) -> dict[str, str]:
    spec = load_spec(tls_spec(tmp_path, cert, key))
    return {issue.loc: issue.message for issue in path_issues(spec, tmp_path)}


def encrypted(key: Path) -> Path:
    assert OPENSSL is not None
    out = key.with_name("encrypted.key")
    subprocess.run(
        [OPENSSL, "pkey", "-in", str(key), "-aes256", "-passout", "pass:x", "-out", str(out)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


def test_a_pair_the_balancer_cannot_load_names_its_field(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "one", "IP:127.0.0.1")
    other_cert, other_key = make_cert(tmp_path, "other", "IP:127.0.0.1")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    assert issues_of(tmp_path, cert, key) == {}

    bad_cert = issues_of(tmp_path, garbage, key)
    assert "no PEM certificate" in bad_cert["service.tls.certfile"], bad_cert
    swapped = issues_of(tmp_path, key, cert)  # the key given as certfile
    assert "no PEM certificate" in swapped["service.tls.certfile"], swapped
    mismatch = issues_of(tmp_path, cert, other_key)
    assert "not the private key of certfile" in mismatch["service.tls.keyfile"], mismatch
    bad_key = issues_of(tmp_path, other_cert, garbage)
    assert "no PEM private key" in bad_key["service.tls.keyfile"], bad_key
    locked = issues_of(tmp_path, cert, encrypted(key))
    assert "encrypted" in locked["service.tls.keyfile"], locked


def test_an_encrypted_key_is_an_error_never_a_prompt(tmp_path: Path) -> None:
    """OpenSSL asks a terminal for a key's passphrase: a daemon run in one (`corral daemon
    run` in a shell) would block its event loop on it, the whole API with it."""
    cert, key = make_cert(tmp_path, "one", "IP:127.0.0.1")
    locked = encrypted(key)
    script = textwrap.dedent(
        f"""
        import ssl
        from corral.dataplane.protocol import Route
        try:
            Route(port=1, tls_cert={str(cert)!r}, tls_key={str(locked)!r}).server_context()
        except (OSError, ssl.SSLError) as exc:
            print("refused:", exc, flush=True)
        """
    )
    main, terminal = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=terminal,
            # Its own session with the pty as its controlling terminal: OpenSSL's /dev/tty.
            preexec_fn=lambda: _take_terminal(terminal),
        )
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("loading a key with a passphrase waited for one on the terminal")
    finally:
        os.close(main)
        os.close(terminal)
    assert b"refused:" in out, out


def _take_terminal(fd: int) -> None:
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(fd, termios.TIOCSCTTY, 0)


def test_update_to_a_mismatched_pair_is_refused_before_anything_changes(
    corral_home: CorralHome, tmp_path: Path
) -> None:
    """Accepted, it rolled the replicas, said the new version serves, kept the old
    certificate, and the next daemon start failed the service (its port closed)."""
    cert, key = make_cert(tmp_path, "one", "IP:127.0.0.1")
    _other_cert, other_key = make_cert(tmp_path, "other", "IP:127.0.0.1")
    base = spec_text("tlsok", 1, period=0.2)
    tls = "  tls:\n    keyfile: {key}\n    certfile: {cert}\n"
    good = write_spec(tmp_path / "good.yaml", base + tls.format(key=key, cert=cert))
    bad = write_spec(tmp_path / "bad.yaml", base + tls.format(key=other_key, cert=cert))

    corral_home.run("up", str(good))
    result = corral_home.run("update", "tlsok", str(bad), check=False)
    assert result.returncode != 0, result.stdout
    assert "service.tls.keyfile" in result.stderr, result.stderr
    assert "not the private key" in result.stderr, result.stderr
    assert corral_home.status("tlsok")["version"] == 1
    corral_home.run("down", "tlsok", "-y")
