"""A small synchronous client of the daemon's API, and starting the daemon on demand.

Synchronous on purpose: the CLI makes one request at a time and a blocking ``http.client`` keeps
it free of an event loop. Streaming (``logs --follow``) reads the chunked answer as it comes.

Where the API is: the home's ``daemon.json`` (host, port, scheme). A daemon serving HTTPS also
records its certificate there, and the client verifies the API against exactly that file (or
``$CORRAL_API_CA`` when set). A daemon bound to every interface (``0.0.0.0``) is reached on
loopback, and a loopback connection accepts a certificate issued to ``localhost`` or a loopback
address; any other host name is checked as usual. ``$CORRAL_API_URL`` (with ``$CORRAL_API_TOKEN``
and ``$CORRAL_API_CA``) points the CLI at a daemon elsewhere instead; plain ``http://`` is
refused for a host that is not loopback, as the token would travel in clear.
"""

from __future__ import annotations

import hmac
import http.client
import json
import os
import secrets
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from corral.apiconn import (
    ENV_API_CA,
    ENV_API_TOKEN,
    ENV_API_URL,
    ClientError,
    DaemonUnreachable,
    Endpoint,
    UntrustedDaemon,
    _unreachable,
    client_tls_context,
    endpoint,
    open_connection,
)
from corral.home import (
    EXIT_DAEMON_RUNNING,
    hello_proof,
    read_info,
    read_token,
)

# Where the API is, TLS and the errors live in corral.apiconn; re-exported for the CLI.
__all__ = [
    "ENV_API_CA",
    "ENV_API_TOKEN",
    "ENV_API_URL",
    "Client",
    "ClientError",
    "DaemonUnreachable",
    "Endpoint",
    "UntrustedDaemon",
    "client_tls_context",
    "endpoint",
    "ensure_daemon",
    "open_connection",
]

# `corral daemon run` exits with this code (EX_TEMPFAIL) when another daemon holds the home's
# lock: two `corral up` raced to start one, and the winner answers once it has started.


class Client:
    def __init__(self, home: Path, timeout: float = 30.0) -> None:
        self.home = home
        self.timeout = timeout
        # Why the last health() said no (None: it said yes, or nothing answered at all).
        self.last_error: ClientError | None = None
        # The endpoint and token that proved to be this home's daemon (see _prove).
        self._trusted: tuple[Endpoint, str] | None = None
        # Whether the daemon answered when the CLI first asked (None: not asked yet).
        self.answered: bool | None = None

    def _connection(
        self, timeout: float | None
    ) -> tuple[http.client.HTTPConnection, str, Endpoint]:
        ep = endpoint(self.home)
        if ep.remote:
            token = os.environ.get(ENV_API_TOKEN, "").strip()
            if not token:
                raise ClientError(f"${ENV_API_URL} is set: set ${ENV_API_TOKEN} to the API token")
        else:
            try:
                token = read_token(self.home)
            except OSError as exc:
                raise ClientError(f"cannot read the API token in {self.home}: {exc}") from None
        if self._trusted != (ep, token):
            try:
                self._prove(ep, token, timeout)
            except UntrustedDaemon:
                raise
            except OSError as exc:
                raise _unreachable(exc, ep) from None
        return open_connection(ep, timeout), token, ep

    def _prove(self, ep: Endpoint, token: str, timeout: float | None) -> None:
        """Ask whoever answers at ``ep`` to prove it holds the token, without sending it.

        A daemon killed without a chance to remove daemon.json leaves its port behind, and any
        local process may listen there: the token (and a spec) must never go to it. The answer
        to a random nonce is an HMAC with the token, bound to the port (``home.hello_proof``).
        Raises :class:`UntrustedDaemon` saying what was found; OSError when nothing answers.
        """
        nonce = secrets.token_hex(16)
        conn = open_connection(ep, timeout)
        try:
            conn.request("GET", "/v1/health?nonce=" + nonce)
            response = conn.getresponse()
            raw = response.read(65536)
        except ssl.SSLCertVerificationError as exc:
            raise _unreachable(exc, ep) from None
        except OSError:
            raise  # nothing (or nothing that stays) answers there: "cannot reach"
        except http.client.HTTPException as exc:
            raise self._impostor(ep, f"it does not speak HTTP as corral does ({exc!r})") from None
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
            proof = str(answer["proof"])
            port = int(answer["port"]) if ep.remote else ep.port
        except (ValueError, KeyError, TypeError):
            raise self._impostor(ep, "it gave no proof that it holds the token") from None
        if not hmac.compare_digest(proof, hello_proof(token, nonce, port)):
            raise self._impostor(ep, "its proof does not match this home's token")
        self._trusted = (ep, token)

    def _impostor(self, ep: Endpoint, why: str) -> UntrustedDaemon:
        import psutil  # only here: every CLI command imports this module

        info = read_info(self.home) or {}
        pid = info.get("pid")
        alive = isinstance(pid, int) and psutil.pid_exists(pid)
        if ep.remote:
            return UntrustedDaemon(
                f"{ep.url} is not the corral daemon $CORRAL_API_TOKEN is for: {why}"
            )
        gone = "" if alive else ", which is not running: its old port is taken by another process"
        return UntrustedDaemon(
            f"something answers at {ep.url} but it is not this home's daemon: {why}. Nothing "
            f"was sent to it (no token). {self.home / 'daemon.json'} names pid {pid}{gone}; "
            "any corral command that needs a daemon (`corral daemon start`) starts a new one.",
            stale=not alive,
        )

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        conn, token, ep = self._connection(self.timeout)
        url = path + ("?" + urlencode(params) if params else "")
        headers = {"Authorization": f"Bearer {token}"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, url, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except OSError as exc:
            raise _unreachable(exc, ep) from None
        except http.client.HTTPException as exc:
            # The answer cut short (IncompleteRead, ...): the daemon died while it answered.
            # Unreachable, not a traceback: the callers then wait for a respawn as for a cut
            # connection, and know that what was asked may have been done.
            raise DaemonUnreachable(
                f"the corral daemon at {ep.url} ended its answer midway ({exc!r})"
            ) from None
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode(errors="replace")
        if response.status >= 400:
            message = data.get("error") if isinstance(data, dict) else str(data)
            raise ClientError(str(message), response.status, data)
        return data

    def stream(self, path: str, params: dict[str, Any]) -> Iterator[bytes]:
        conn, token, ep = self._connection(None)
        try:
            conn.request(
                "GET", path + "?" + urlencode(params), headers={"Authorization": f"Bearer {token}"}
            )
            response = conn.getresponse()
            if response.status >= 400:
                raw = response.read()
                try:
                    message = json.loads(raw).get("error")
                except ValueError:
                    message = raw.decode(errors="replace")
                raise ClientError(str(message), response.status)
            while True:
                chunk = response.read1(65536)
                if not chunk:
                    return
                yield chunk
        except OSError as exc:
            raise _unreachable(exc, ep) from None
        except http.client.HTTPException as exc:  # the answer cut short: IncompleteRead, ...
            raise ClientError(
                f"the corral daemon at {ep.url} ended the answer midway ({exc!r}); "
                "if it stopped, `corral daemon start` brings it back"
            ) from None
        finally:
            conn.close()

    # -- operations ---------------------------------------------------------------------------

    def health(self) -> bool:
        """This home's daemon answers, and proved it (see :meth:`_prove`). Something that
        answers but fails TLS verification or the proof is not healthy, and ``last_error``
        says so (``ensure_daemon`` must not start another one beside a live daemon)."""
        self.last_error = None
        self._trusted = None
        try:
            self._connection(2.0)
        except ClientError as exc:
            self.last_error = exc
            return False
        except OSError:
            return False
        return True

    def services(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/services")["services"])

    def service(self, name: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/services/{quote(name, safe='')}"))

    def create(
        self,
        spec: str,
        *,
        name: str | None,
        source: str | None,
        base_dir: str | None,
        envs: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body = {
            "spec": spec,
            "name": name,
            "source": source,
            "base_dir": base_dir,
            "envs": envs or {},
            "secrets": secrets or {},
        }
        return dict(self.request("POST", "/v1/services", body))

    def update(
        self,
        name: str,
        spec: str | None,
        *,
        mode: str,
        source: str | None = None,
        base_dir: str | None = None,
        from_version: int | None = None,
        envs: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body = {
            "spec": spec,
            "mode": mode,
            "source": source,
            "base_dir": base_dir,
            "from_version": from_version,
            "envs": envs or {},
            "secrets": secrets or {},
        }
        return dict(self.request("POST", f"/v1/services/{quote(name, safe='')}/versions", body))

    def down(self, name: str, *, purge: bool = False) -> dict[str, Any]:
        params = {"purge": "true"} if purge else None
        return dict(self.request("DELETE", f"/v1/services/{quote(name, safe='')}", params=params))

    def terminate_replica(self, name: str, replica: int, *, purge: bool = False) -> str:
        """Tear one replica down (it is replaced), or with ``purge`` forget a failed one."""
        answer = self.request(
            "DELETE",
            f"/v1/services/{quote(name, safe='')}/replicas/{replica}",
            params={"purge": "true"} if purge else None,
        )
        return str(answer.get("message", ""))

    def events(self, name: str, after: int = 0) -> list[dict[str, Any]]:
        data = self.request(
            "GET", f"/v1/services/{quote(name, safe='')}/events", params={"after": after}
        )
        return list(data["events"])

    def logs(
        self,
        name: str,
        *,
        kind: str,
        replica: int | None,
        follow: bool,
        offset: int = 0,
        tail: int | None = None,
    ) -> Iterator[bytes]:
        params: dict[str, Any] = {
            "kind": kind,
            "follow": "true" if follow else "false",
            "offset": offset,
        }
        if tail is not None:
            params["tail"] = tail
        if replica is not None:
            params["replica"] = replica
        return self.stream(f"/v1/services/{quote(name, safe='')}/logs", params)

    def stop_daemon(self, *, workers: bool = False) -> bool:
        """Stop the control plane; with ``workers`` the balancer workers too. Returns whether
        the workers stop (they also do when no service is left)."""
        answer = self.request("POST", "/v1/daemon/stop", params={"all": "1"} if workers else None)
        return bool(answer.get("balancer_workers_stop", workers))


def ensure_daemon(home: Path, timeout: float = 20.0) -> Client:
    """Return a client of the home's daemon, starting the daemon if none answers."""
    client = Client(home)
    if client.health():
        return client
    if os.environ.get(ENV_API_URL):
        raise client.last_error or ClientError(
            f"no corral daemon answers at ${ENV_API_URL} ({os.environ[ENV_API_URL]})"
        )
    error = client.last_error
    if isinstance(error, UntrustedDaemon) and not error.stale:
        raise error  # a daemon answers that we cannot verify: not a new one beside it
    log_path = home / "daemon.log"
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)  # the daemon narrows an old one too
        log = open(log_path, "ab")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise ClientError(
            f"cannot use {home} as the corral home ({exc.strerror or exc}); "
            "set CORRAL_HOME (or --home) to a directory you can write"
        ) from None
    with log:
        env = dict(os.environ)
        env["CORRAL_HOME"] = str(home)
        process = subprocess.Popen(
            # The home goes in the environment, not the command line: every process (replicas
            # included) can read another's command line, and none may learn the home's path.
            [sys.executable, "-m", "corral", "daemon", "run"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env=env,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.health():
            return client
        code = process.poll()
        if code is not None:
            if client.health():  # another `corral up` won the race and its daemon answers
                return client
            if code == EXIT_DAEMON_RUNNING:
                # The winner may still be starting (daemon.json is written once it listens).
                time.sleep(0.05)
                continue
            tail = _tail(log_path)
            raise ClientError(f"the corral daemon exited with code {code}; {log_path}:\n{tail}")
        time.sleep(0.05)
    raise ClientError(f"the corral daemon did not answer within {timeout:g}s; see {log_path}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
