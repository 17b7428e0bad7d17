"""Reading a JSON request body for the daemon's HTTP handlers (the API and the dashboard).

Why a deadline: aiohttp has no timeout of its own for a body, so a client announcing a length
and then trickling (or never sending) the bytes would hold its handler forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from corral.api_errors import RequestError


async def json_object(request: web.Request, timeout: float) -> dict[str, Any]:
    """The JSON object of ``request``'s body, read within ``timeout`` s; 408 or 400 if not."""
    try:
        async with asyncio.timeout(timeout):
            body = await request.json()
    except TimeoutError:
        raise RequestError(408, "timed out reading the request body") from None
    except web.RequestPayloadError:
        # A body that is not what its Content-Encoding says (or ends early): aiohttp's own
        # exception, not a ValueError; unhandled it was a 500.
        raise RequestError(400, "the request body cannot be read (its Content-Encoding?)") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: arrays or objects nested past Python's recursion limit (json.loads
        # raises it, not a ValueError); unhandled it was a 500.
        raise RequestError(400, "request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body
