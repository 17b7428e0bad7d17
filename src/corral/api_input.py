"""Reading what a request to the API says: its JSON body, text fields, flags and numbers.

Why strict: every value here ends up in SQLite, a path, an argument or a ``seek``; a value that
cannot (a lone surrogate, a NUL, a number past 64 bits) is refused with a 400 naming the field
rather than failing deeper as a 500. Most of these limits were found by fuzzing the API.
"""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

from corral.api_errors import RequestError
from corral.httpbody import json_object

# The largest id, version or offset accepted: SQLite's INTEGER is 64-bit signed.
MAX_INT = (1 << 63) - 1

# A client has this long to send a whole request head, and again to send its body; the API's
# only clients are the CLI and tools on this machine, which send theirs at once.
# ``CORRAL_API_HEADER_TIMEOUT`` (seconds) in the daemon's environment overrides it (tests).
HEADER_TIMEOUT_SECONDS = 10.0


def client_timeout() -> float:
    try:
        timeout = float(os.environ.get("CORRAL_API_HEADER_TIMEOUT", HEADER_TIMEOUT_SECONDS))
    except ValueError:
        return HEADER_TIMEOUT_SECONDS
    return timeout if 0 < timeout < 3600 else HEADER_TIMEOUT_SECONDS


async def body_of(request: web.Request) -> dict[str, Any]:
    return await json_object(request, client_timeout())


def optional_values(body: dict[str, Any], key: str) -> dict[str, str]:
    """A mapping of environment variable names to values (``envs``, ``secrets``), or {}."""
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise RequestError(400, f"field {key!r} must map names to strings")
    for name, text in value.items():
        if "\0" in name or "\0" in text or not name.isascii():
            raise RequestError(400, f"field {key!r}: names and values cannot hold NUL")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, f"field {key!r}: values must be valid text") from None
    return dict(value)


def optional_str(body: dict[str, Any], key: str) -> str | None:
    """A text field of a request body, or None.

    The text must be storable and usable as a path: JSON's ``"\\ud800"`` decodes to a lone
    surrogate that SQLite cannot encode (a 500, found by fuzzing), and a NUL cannot be in a
    path or an argument.
    """
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(400, f"field {key!r} must be a string")
    if "\0" in value:
        raise RequestError(400, f"field {key!r} must not contain a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"field {key!r} is not valid Unicode text") from None
    return value


def optional_dir(body: dict[str, Any], key: str) -> str | None:
    """A directory field (``base_dir``: where the spec's relative paths are taken from), or
    None. Absolute only: a relative one would be taken from the daemon's own working
    directory, which no client means (`workdir: .` would copy the daemon's)."""
    value = optional_str(body, key)
    if value is not None and not os.path.isabs(value):
        raise RequestError(400, f"field {key!r} must be an absolute path, not {value!r}")
    return value


def optional_version(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_INT
    ):
        raise RequestError(400, f"field {key!r} must be a version number (>= 1)")
    return value


def flag(request: web.Request, key: str) -> bool:
    value = request.query.get(key, "0").lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise RequestError(400, f"query parameter {key!r} must be true or false, got {value!r}")


def int_param(request: web.Request, key: str, default: int) -> int:
    """A non-negative integer query parameter that SQLite and ``seek`` can take.

    ASCII digits only: ``int()`` also reads "\\u0661" (an Arabic-Indic one), "1_0" and " 1 ", which
    no client means. At most 2**63 - 1: ids and offsets beyond it made SQLite raise
    OverflowError, a 500 (found by fuzzing).
    """
    value = request.query.get(key)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()):
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise RequestError(
            400, f"query parameter {key!r} must be a whole number >= 0, got {shown!r}"
        )
    if len(value) > 19 or int(value) > MAX_INT:
        raise RequestError(400, f"query parameter {key!r} must be at most {MAX_INT}")
    return int(value)
