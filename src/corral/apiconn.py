"""Where the daemon's API is and how to reach it safely: the endpoint, TLS, and the errors.

Split from :mod:`corral.client` (which re-exports all of it): this is the part that decides
whom the CLI trusts with its token (see that module's docstring for the rules), so it is kept
small enough to review alone.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from corral.home import WILDCARD_HOSTS, is_loopback, read_info

ENV_API_URL = "CORRAL_API_URL"
ENV_API_TOKEN = "CORRAL_API_TOKEN"
ENV_API_CA = "CORRAL_API_CA"


class ClientError(Exception):
    """The daemon refused a request, or could not be reached. ``str()`` is for the user."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class DaemonUnreachable(ClientError):
    """No daemon answers (none started, or it stopped): the next step is to start one."""


class UntrustedDaemon(ClientError):
    """Something answers on the daemon's address but fails TLS verification, or cannot prove
    it holds the token. ``stale``: the daemon that daemon.json names is not running (another
    process took its old port), so starting a new daemon is the cure."""

    def __init__(self, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


@dataclass(frozen=True)
class Endpoint:
    """Where the API is and how to trust it. ``ca`` is a PEM file (None: the system's CAs)."""

    scheme: str
    host: str
    port: int
    ca: str | None = None
    remote: bool = False  # from $CORRAL_API_URL: the token comes from $CORRAL_API_TOKEN

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def endpoint(home: Path) -> Endpoint:
    """The API of ``home``'s daemon, or of ``$CORRAL_API_URL``; :class:`ClientError` if none."""
    url = os.environ.get(ENV_API_URL)
    if url:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"${ENV_API_URL} must be https://HOST:PORT, not {url!r}")
        if parts.scheme == "http" and not is_loopback(parts.hostname):
            raise ClientError(
                f"${ENV_API_URL} is plain http to {parts.hostname}, which is not loopback: "
                "the token would travel in clear; use https://"
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ClientError(f"${ENV_API_URL} has a bad port: {url!r}") from None
        return Endpoint(parts.scheme, parts.hostname, port, os.environ.get(ENV_API_CA), True)
    info = read_info(home)
    if info is None:
        raise DaemonUnreachable(
            f"no corral daemon runs on {home}: start one with `corral daemon start`"
        )
    host = str(info.get("host") or "127.0.0.1")
    if host in WILDCARD_HOSTS:
        host = "::1" if host == "::" else "127.0.0.1"
    scheme = str(info.get("scheme") or "http")
    ca = os.environ.get(ENV_API_CA) or info.get("tls_cert")
    return Endpoint(scheme, host, int(info["port"]), str(ca) if ca else None)


def client_tls_context(ca: str | None, *, loopback: bool) -> ssl.SSLContext:
    """Verify the API's certificate against ``ca``; on loopback the name is checked by
    :class:`_LoopbackHTTPSConnection` instead of OpenSSL (see there)."""
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ClientError(f"cannot load the API's CA certificate {ca}: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # The daemon's own certificate (recorded in daemon.json) is the trust anchor even when it is
    # a leaf issued by some CA rather than self-signed.
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if loopback:
        context.check_hostname = False  # verify_mode stays CERT_REQUIRED
    return context


def _names_loopback(cert: dict[str, Any]) -> bool:
    """The certificate is issued to ``localhost`` or a loopback address (subjectAltName)."""
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "DNS" and str(value).lower() == "localhost":
            return True
        if kind == "IP Address":
            try:
                if ipaddress.ip_address(str(value).strip()).is_loopback:
                    return True
            except ValueError:
                continue
    return False


class _LoopbackHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a loopback address, accepting a certificate issued to any loopback name.

    A daemon bound to ``0.0.0.0`` is reached on 127.0.0.1 while its certificate may name
    ``localhost`` (or the other way round), and OpenSSL's check wants one exact name. The chain
    is still verified by OpenSSL; only the name is checked here, right after the handshake and
    before any byte (the token) is sent.
    """

    def connect(self) -> None:
        super().connect()
        cert = self.sock.getpeercert()
        if not cert or not _names_loopback(cert):
            self.sock.close()
            raise ssl.SSLCertVerificationError(
                "the API's certificate names neither localhost nor a loopback address"
            )


def open_connection(ep: Endpoint, timeout: float | None) -> http.client.HTTPConnection:
    """An unconnected HTTP(S) connection to ``ep`` (connecting happens on the first request)."""
    if ep.scheme == "http":
        return http.client.HTTPConnection(ep.host, ep.port, timeout=timeout)
    loopback = is_loopback(ep.host)
    context = client_tls_context(ep.ca, loopback=loopback)
    cls = _LoopbackHTTPSConnection if loopback else http.client.HTTPSConnection
    return cls(ep.host, ep.port, timeout=timeout, context=context)


def _unreachable(exc: OSError, ep: Endpoint) -> ClientError:
    if isinstance(exc, ssl.SSLCertVerificationError):
        trusted = ep.ca or "the system's CAs"
        return UntrustedDaemon(
            f"the corral daemon at {ep.url} did not prove who it is (TLS, trusting {trusted}; "
            f"set ${ENV_API_CA} to its certificate): {exc}"
        )
    if isinstance(exc, ConnectionRefusedError):
        why = "nothing listens there"
    elif isinstance(exc, TimeoutError):
        why = "it did not answer in time"
    else:
        why = exc.strerror or str(exc) or type(exc).__name__
    if ep.remote:
        return DaemonUnreachable(
            f"the corral daemon at {ep.url} (${ENV_API_URL}) is not reachable ({why}); "
            f"check that it runs and that ${ENV_API_URL} names it"
        )
    return DaemonUnreachable(
        f"the corral daemon is not reachable at {ep.url} ({why}); "
        "start it with `corral daemon start`"
    )
