"""Ctrl-C while `corral` is starting: one line and exit code 130, not a traceback.

Importing the CLI takes a noticeable moment (click, rich, http.client; more on a busy
machine), and a KeyboardInterrupt raised inside those imports escapes every handler the
commands have: the console script itself prints a traceback of some library's import. So this
module, imported first by :mod:`corral.cli` (before anything that takes time), installs a
SIGINT handler that ends the process quietly. Nothing has been done yet at that point, so there
is nothing to say but that. :func:`commands_take_over` puts Python's default handler back once
a command is about to run: the commands turn KeyboardInterrupt into what it leaves running.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

# Exit code of a command stopped by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
STARTUP_MESSAGE = b"\ninterrupted while corral was starting: nothing was done\n"


def _quiet_exit(signum: int, frame: FrameType | None) -> None:
    """End the process at once: raising here would unwind through whatever import runs."""
    try:
        os.write(2, STARTUP_MESSAGE)
    finally:
        os._exit(EXIT_INTERRUPTED)


def as_program(argv0: str) -> bool:
    """This process is the `corral` command (the console script, or `python -m corral`), not a
    program that imports the CLI (a test, a benchmark): only the command may end this way."""
    path = Path(argv0)
    return path.name == "corral" or (path.name == "__main__.py" and path.parent.name == "corral")


def quiet_start() -> None:
    """From now until :func:`commands_take_over`, Ctrl-C ends corral with one line."""
    installed = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if installed and sys.argv and as_program(sys.argv[0]):
        signal.signal(signal.SIGINT, _quiet_exit)


def commands_take_over() -> None:
    """Back to KeyboardInterrupt, which the commands catch (if SIGINT was not ignored)."""
    if signal.getsignal(signal.SIGINT) is _quiet_exit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


quiet_start()
