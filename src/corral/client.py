"""A small synchronous client of the daemon's API, and starting the daemon on demand.

Synchronous on purpose: the CLI makes one request at a time and a blocking ``http.client`` keeps
it free of an event loop. Streaming (``logs --follow``) reads the chunked answer as it comes.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from corral.home import EXIT_DAEMON_RUNNING, read_info, read_token

# `corral daemon run` exits with this code (EX_TEMPFAIL) when another daemon holds the home's
# lock: two `corral up` raced to start one, and the winner answers once it has started.


class ClientError(Exception):
    """The daemon refused a request, or could not be reached. ``str()`` is for the user."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class Client:
    def __init__(self, home: Path, timeout: float = 30.0) -> None:
        self.home = home
        self.timeout = timeout

    def _connection(self, timeout: float | None) -> tuple[http.client.HTTPConnection, str]:
        info = read_info(self.home)
        if info is None:
            raise ClientError(f"no corral daemon runs on {self.home} (start one with `corral up`)")
        try:
            token = read_token(self.home)
        except OSError as exc:
            raise ClientError(f"cannot read the API token in {self.home}: {exc}") from None
        conn = http.client.HTTPConnection(str(info["host"]), int(info["port"]), timeout=timeout)
        return conn, token

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> Any:
        conn, token = self._connection(self.timeout)
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
            raise ClientError(f"cannot reach the corral daemon: {exc}") from None
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
        conn, token = self._connection(None)
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
            raise ClientError(f"cannot reach the corral daemon: {exc}") from None
        finally:
            conn.close()

    # -- operations ---------------------------------------------------------------------------

    def health(self) -> bool:
        try:
            conn, _ = self._connection(2.0)
        except ClientError:
            return False
        try:
            conn.request("GET", "/v1/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def services(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/services")["services"])

    def service(self, name: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/services/{quote(name, safe='')}"))

    def create(
        self, spec: str, *, name: str | None, source: str | None, base_dir: str | None
    ) -> dict[str, Any]:
        body = {"spec": spec, "name": name, "source": source, "base_dir": base_dir}
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
    ) -> dict[str, Any]:
        body = {
            "spec": spec,
            "mode": mode,
            "source": source,
            "base_dir": base_dir,
            "from_version": from_version,
        }
        return dict(self.request("POST", f"/v1/services/{quote(name, safe='')}/versions", body))

    def down(self, name: str, *, purge: bool = False) -> dict[str, Any]:
        params = {"purge": "true"} if purge else None
        return dict(self.request("DELETE", f"/v1/services/{quote(name, safe='')}", params=params))

    def events(self, name: str, after: int = 0) -> list[dict[str, Any]]:
        data = self.request(
            "GET", f"/v1/services/{quote(name, safe='')}/events", params={"after": after}
        )
        return list(data["events"])

    def logs(
        self, name: str, *, kind: str, replica: int | None, follow: bool, offset: int = 0
    ) -> Iterator[bytes]:
        params: dict[str, Any] = {
            "kind": kind,
            "follow": "true" if follow else "false",
            "offset": offset,
        }
        if replica is not None:
            params["replica"] = replica
        return self.stream(f"/v1/services/{quote(name, safe='')}/logs", params)

    def stop_daemon(self) -> None:
        self.request("POST", "/v1/daemon/stop")


def ensure_daemon(home: Path, timeout: float = 20.0) -> Client:
    """Return a client of the home's daemon, starting the daemon if none answers."""
    client = Client(home)
    if client.health():
        return client
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / "daemon.log"
    with open(log_path, "ab") as log:
        env = dict(os.environ)
        env["CORRAL_HOME"] = str(home)
        process = subprocess.Popen(
            [sys.executable, "-m", "corral", "daemon", "run", "--home", str(home)],
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
