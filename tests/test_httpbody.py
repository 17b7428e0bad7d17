"""corral.httpbody: a request body that is not a JSON object is a 400, whatever its shape.

Why: the API and the dashboard read every body through json_object, and a refusal there must be
an answer the client can act on, never a 500 (the daemon log's "internal error").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
from aiohttp import web

from corral.api_errors import RequestError
from corral.httpbody import json_object


class _Body:
    """Stands in for an aiohttp request: json() decodes ``text`` as aiohttp does (json.loads)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def json(self) -> Any:
        return json.loads(self.text)


def _read(text: str) -> dict[str, Any]:
    return asyncio.run(json_object(cast(web.Request, _Body(text)), 5.0))


def test_deeply_nested_json_is_a_400_not_a_500() -> None:
    # json.loads raises RecursionError (not ValueError) past Python's recursion limit.
    nested = '{"spec": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(RequestError) as refused:
        _read(nested)
    assert refused.value.status == 400
    assert "JSON" in refused.value.message


def test_a_json_object_is_read() -> None:
    assert _read('{"spec": "run: x"}') == {"spec": "run: x"}


async def _post(body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """POST ``body`` to a one-route aiohttp app that reads it with json_object: the status,
    and the message, the app answers (a RequestError as 4xx, anything else escapes)."""
    from aiohttp.test_utils import TestClient, TestServer

    async def handler(request: web.Request) -> web.Response:
        try:
            return web.json_response(await json_object(request, 5.0))
        except RequestError as exc:
            return web.json_response({"error": exc.message}, status=exc.status)

    app = web.Application()
    app.router.add_post("/", handler)
    async with TestClient(TestServer(app)) as client:
        answer = await client.post("/", data=body, headers=headers)
        return answer.status, await answer.text()


def test_a_body_its_content_encoding_cannot_decode_is_a_400() -> None:
    # aiohttp raises RequestPayloadError (not a ValueError) for a body that is not what its
    # Content-Encoding says; the API answered 500 "internal error".
    status, text = asyncio.run(_post(b'{"spec": "x"}', {"Content-Encoding": "gzip"}))
    assert status == 400, text
    assert "body" in text
