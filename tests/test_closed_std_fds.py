"""`corral daemon run` started with its standard descriptors closed does not hand 1 and 2 to
the files and sockets it opens (where a fatal error, C code or an inheriting child would then
write)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import socket, sys
from corral import cli
try:
    # Refused (a certificate without its key) before anything is opened or served.
    cli.main(["daemon", "run", "--tls-cert", "cert.pem"], standalone_mode=False)
except BaseException:
    pass
sock = socket.socket()
with open(sys.argv[1], "w") as out:
    out.write(str(sock.fileno()))
"""


def test_daemon_run_with_closed_stdout_and_stderr_keeps_them_off_its_files(
    tmp_path: Path,
) -> None:
    result = tmp_path / "fd"
    env = {**os.environ, "CORRAL_HOME": str(tmp_path / "home")}
    code = subprocess.run(
        ["sh", "-c", 'exec "$0" -c "$1" "$2" >&- 2>&-', sys.executable, CHILD, str(result)],
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    ).returncode
    assert code == 0
    assert int(result.read_text()) > 2  # a socket on fd 1 or 2 would get stray writes
