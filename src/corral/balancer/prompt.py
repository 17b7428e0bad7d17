"""The text of a request that an LLM engine can serve from its prefix (KV) cache.

A prefix-aware policy routes on what an engine would find in its cache: the prompt as the engine
sees it, from its first character. So this module reads that text out of a request body, for
the APIs LLM engines serve (vLLM, SGLang, TGI, llama.cpp's server):

* ``/v1/chat/completions``: the whole ``messages`` list, in order (each message's role, name,
  content, tool calls), after ``tools`` when there are any. An engine renders the whole list
  through its chat template, so the conversation so far is the reusable prefix, not its first
  message. The rendering is a concatenation, one piece per message, so a later turn of a
  conversation (the earlier turn's messages plus new ones, the same tools) renders to a text
  that starts with the earlier turn's text, exactly: a turn finds the cache its predecessor
  left. Tools go first for that reason, as chat templates put them.
* ``/v1/completions``: ``prompt`` (a string, a batch of strings joined, token ids rendered as
  decimal text with a marker, so a token prefix is a text prefix).
* ``/generate``: ``text`` (SGLang), ``inputs`` (TGI) or ``input_ids`` (SGLang's token ids).
* Any other path: whichever of those fields the body has; a spec may name its own field (a
  dotted path, ``input.text``), read first.

The result is only ever a routing hint: a body this module does not understand gives None and
the request is routed by load. So nothing here raises on input, whatever the bytes: not JSON,
not an object, wrong types, a missing or empty field are all None. The body is parsed once
(twice for what orjson refuses, ``_parse``), no regular expression runs, and the rendering is a
join of the strings the parser made.

Not a model's real chat template (that needs the tokenizer and the template, per model): two
requests the engine renders alike may render differently here (a message with content None and
one with ``""``, say), which costs a cache miss in routing, never a wrong answer.
"""

from __future__ import annotations

import json
from typing import Any, Final, NamedTuple

import orjson

__all__ = ["Prompt", "extract_prompt", "read_prompt"]

# Separators in the rendering. Control characters, rare in prompts, so that two different
# message lists rarely render alike; an ambiguity would only merge two routing keys.
_MESSAGE: Final = "\x1d"
_FIELD: Final = "\x1f"
_END: Final = "\n"
_TOKENS: Final = "\x02"  # a token-id prompt is never mistaken for the same digits as text
_BATCH: Final = "\x1e"

# How far past ``limit`` a chat is rendered to reach its first user message (the end of its
# anchor): a system prompt up to this many limits long still tells conversations apart, and a
# chat with no user message, or with it last, costs at most this much (it was rendered whole:
# 51-53 ms for 1.2 MiB of tool calls, twice the 25 ms when the user message comes first).
ANCHOR_LIMITS: Final = 4

_CHAT_FIELDS: Final = ("messages", "prompt", "text", "inputs", "input_ids")
_COMPLETION_FIELDS: Final = ("prompt", "messages", "text", "inputs", "input_ids")
_GENERATE_FIELDS: Final = ("text", "inputs", "input_ids", "prompt", "messages")


class Prompt(NamedTuple):
    """A request's prompt: its rendered ``text`` and where a conversation's anchor ends.

    ``anchor_end`` is the length of the part every later turn of the same conversation repeats
    and nothing else tells apart: for chat (``chat`` true), up to the end of the first user
    message (tools, system prompt and that message); for other APIs, which carry no turns, the
    whole text, and a policy cuts it at a length of its choosing.
    """

    text: str
    anchor_end: int
    chat: bool = False


def extract_prompt(path: str, body: bytes, field: str | None = None) -> str | None:
    """The text an engine would reuse as a KV-cache prefix, or None when there is none.

    ``path`` is the request target (a query string is ignored); ``field`` a JSON field the
    spec names (dotted path), read before the known ones.
    """
    prompt = read_prompt(path, body, field)
    return None if prompt is None else prompt.text


def read_prompt(
    path: str, body: bytes, field: str | None = None, limit: int | None = None
) -> Prompt | None:
    """The prompt of a request and its anchor's end; None for a body without one. Never
    raises. ``limit``: characters past which the rendering may stop (the policy hashes no
    further): a body of many tiny parts (a million one-token lists) then costs its parse, not
    a Python step per part (measured: 400 ms of the event loop for 1 MiB of them)."""
    try:
        doc = _parse(body)
    except (ValueError, TypeError, RecursionError):
        return None
    if type(doc) is not dict:
        return None
    try:
        return _from_doc(doc, path, field, limit)
    except (ValueError, TypeError, RecursionError):  # json.dumps of a pathological value
        return None


def _parse(body: bytes) -> Any:
    """The body as JSON: orjson's parse, and the standard library's for what orjson refuses
    and it takes (lone surrogates, which clients send in escapes, NaN, UTF-16 and UTF-32), so
    the same document either way but for one case: an integer past 64 bits, which orjson
    reads as a float (rendered as one; every worker reads it alike). Why two: the policy
    parses every request's body on the event loop, and from cold caches (a router's case)
    orjson takes about 11 us of a 3,400-character prompt where ``json`` takes 29
    (docs/benchmarks.md)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def _from_doc(
    doc: dict[str, Any], path: str, field: str | None, limit: int | None
) -> Prompt | None:
    """The prompt in a parsed body: the spec's field first, then the known fields in the order
    the path suggests. A field that is present decides (a wrong type there is None, not a
    fall-through to another field)."""
    if field:
        value = _dotted(doc, field)
        if value is not None:
            return _render(value, None, None, limit)
    path = path.partition("?")[0].rstrip("/")
    if path.endswith("/chat/completions"):
        order = _CHAT_FIELDS
    elif path.endswith("/completions"):
        order = _COMPLETION_FIELDS
    elif path.endswith(("/generate", "/generate_stream")):
        order = _GENERATE_FIELDS
    else:
        order = _CHAT_FIELDS
    for name in order:
        value = doc.get(name)
        if value is not None:
            chat = name == "messages"
            return _render(value, doc.get("tools") if chat else None, chat, limit)
    return None


def _dotted(doc: Any, field: str) -> Any:
    """``doc``'s value at a dotted path (``input.text``, ``inputs.0``), or None."""
    value = doc
    for key in field.split("."):
        if type(value) is dict:
            value = value.get(key)
        elif type(value) is list and key.isdecimal() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
    return value


def _render(value: Any, tools: Any, chat: bool | None, limit: int | None) -> Prompt | None:
    """A field's value as prompt text, by its JSON type; None for a type no engine takes
    there. ``chat``: the value must be a message list (True), must not be (False), or the
    spec's field, either (None)."""
    if type(value) is str and chat is not True:
        return Prompt(value, len(value)) if value else None
    if type(value) is not list or not value:
        return None
    kinds = set(map(type, value))
    if chat is True or kinds == {dict}:
        return _chat(value, tools, limit) if kinds == {dict} and chat is not False else None
    if kinds == {str}:
        text = _BATCH.join(value)
    elif kinds == {int}:
        # Each id renders to two characters at least, so ``limit`` of them reach past what is
        # hashed; the rest cost a str() each (a 1 MiB prompt of ids: 66 ms of the event loop).
        text = _tokens(value if limit is None else value[:limit])
    elif kinds == {list}:
        rendered = []
        size = 0
        for ids in value:
            if not ids or set(map(type, ids)) != {int}:
                return None
            rendered.append(_tokens(ids))
            size += len(rendered[-1]) + 1
            if limit is not None and size > limit:
                break  # the rest is past what is hashed
        text = _BATCH.join(rendered)
    else:
        return None
    return Prompt(text, len(text)) if text else None


def _tokens(ids: list[int]) -> str:
    """Token ids as text: each id ends with a separator, so one id list being a prefix of
    another makes its text a prefix of the other's (``1,2,`` of ``1,2,3,``, not of ``1,23,``)."""
    return _TOKENS + ",".join(map(str, ids)) + ","


def _chat(messages: list[dict[str, Any]], tools: Any, limit: int | None) -> Prompt | None:
    """A chat conversation as one text: tools, then each message in order (those past
    ``limit`` characters left out)."""
    pieces = []
    if tools is not None and tools != []:
        pieces.append(_MESSAGE + "tools" + _FIELD + _dump(tools) + _END)
    length = len(pieces[0]) if pieces else 0
    anchor_end = -1
    for message in messages:
        piece = _message(message, limit)
        if piece is None:
            return None
        pieces.append(piece)
        length += len(piece)
        if anchor_end < 0 and message["role"] == "user":
            anchor_end = length
        if limit is not None and length > limit:
            if anchor_end >= 0:
                break  # past what is hashed, the anchor (to the first user message) whole
            if length > ANCHOR_LIMITS * limit:
                break  # no user message this far: the anchor is what was rendered
    return Prompt("".join(pieces), anchor_end if anchor_end >= 0 else length, chat=True)


def _message(message: dict[str, Any], limit: int | None) -> str | None:
    """One message's piece of the rendering, or None for a message of the wrong shape."""
    role = message.get("role")
    if type(role) is not str:
        return None
    content = _content(message.get("content"), limit)
    if content is None:
        return None
    head = _MESSAGE + role
    name = message.get("name")
    if type(name) is str:
        head += _FIELD + name
    tail = ""
    call_id = message.get("tool_call_id")
    if type(call_id) is str:
        tail += _FIELD + call_id
    calls = message.get("tool_calls")
    if calls is not None:
        tail += _FIELD + _dump(calls)
    return head + _FIELD + content + tail + _END


def _content(content: Any, limit: int | None) -> str | None:
    """A message's content as text: a string, or a list of parts whose text parts are read as
    they are and other parts (images, audio) as stable JSON, up to ``limit`` characters;
    None for another type."""
    if type(content) is str:
        return content
    if content is None:  # an assistant message that only calls tools
        return ""
    if type(content) is not list:
        return None
    out = []
    size = 0
    for part in content:
        if type(part) is str:
            out.append(part)
        elif type(part) is not dict:
            return None
        elif part.get("type") == "text" and type(part.get("text")) is str:
            out.append(part["text"])
        else:
            out.append(_FIELD + _dump(part) + _FIELD)
        size += len(out[-1])
        if limit is not None and size > limit:
            break
    return "".join(out)


def _dump(value: Any) -> str:
    """JSON with sorted keys and no spaces: the same value renders the same whatever the key
    order or spacing the client sent."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
