"""The wire formats: the request shapes of OpenAI, SGLang and TGI read into prompt bytes, and
tokens written back as the JSON or Server-Sent Events a client of a real engine expects.

Apart from the HTTP plumbing (:mod:`corral.llmsim.server`) so the shapes can be checked without a
socket. A chat is rendered whole (system prompt, tools, every turn in order, then the assistant's
cue), as a chat template would, so its cacheable prefix is the conversation so far and never its
first message alone. What cannot be read raises :class:`Rejected` (the server's 400).
"""

from __future__ import annotations

import json
import time
from typing import Any

from corral.llmsim.cache import Rejected, answer_text, encode_ids, encode_text, token_text
from corral.llmsim.engine import Sequence

DONE = b"data: [DONE]\n\n"
Json = dict[str, Any]


def event(payload: Json) -> bytes:
    """One Server-Sent Event, compact: a stream writes one per token."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def json_body(raw: bytes) -> Json:
    try:
        body = json.loads(raw)
    except ValueError:  # also a body that is not UTF-8
        raise Rejected("the body is not valid JSON") from None
    except RecursionError:  # nested deeper than the parser's recursion limit
        raise Rejected("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise Rejected("the body must be a JSON object")
    return body


def positive_int(value: object, default: int, name: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Rejected(f"{name} must be a positive integer")
    return value


def flag(body: Json, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise Rejected(f"{name} must be true or false")
    return value


def include_usage(body: Json) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise Rejected("stream_options must be an object")
    return flag(options, "include_usage")


def completion_prompts(value: object) -> tuple[list[bytes], bool]:
    """``prompt`` as OpenAI reads it: a text, a list of texts (one choice each) or token ids;
    and whether it is text (an answer continues a text, not ids)."""
    if isinstance(value, str):
        return [encode_text(value)], True
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [encode_text(v) for v in value], True
    if isinstance(value, list) and value and all(_is_int(v) for v in value):
        return [encode_ids(value)], False
    raise Rejected("prompt must be a string, a list of strings or a list of token ids")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def render_chat(messages: object, tools: object = None) -> str:
    """The chat as one prompt, in ChatML's shape. Tools follow a leading system message (as
    Qwen's template puts them), so chats that share a system prompt share its blocks."""
    if not isinstance(messages, list) or not messages:
        raise Rejected("messages must be a non-empty list")
    if tools is not None and not isinstance(tools, list):
        raise Rejected("tools must be a list")
    lead = 1 if isinstance(messages[0], dict) and messages[0].get("role") == "system" else 0
    parts = [_render_message(message) for message in messages[:lead]]
    if tools:
        parts.append(f"<|im_start|>tools\n{json.dumps(tools, sort_keys=True)}<|im_end|>\n")
    parts += [_render_message(message) for message in messages[lead:]]
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _render_message(message: object) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Rejected("each message must be an object with a string role")
    text = _content_text(message.get("content"))
    # tool calls, a tool result's call id, a name: part of what the model reads
    extra = {key: value for key, value in message.items() if key not in ("role", "content")}
    if extra:
        text += json.dumps(extra, sort_keys=True)
    return f"<|im_start|>{message['role']}\n{text}<|im_end|>\n"


def _content_text(content: object) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise Rejected("a message's content must be a string or a list of parts")
    texts = []
    for part in content:
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:  # an image or audio part: stands for itself, so equal parts share cache
            texts.append(json.dumps(part, sort_keys=True))
    return "".join(texts)


def generate_request(body: Json, default_max_tokens: int) -> tuple[bytes, int, bool]:
    """SGLang's ``/generate`` (``text``, ``sampling_params``) or TGI's (``inputs``,
    ``parameters``): the prompt, max_new_tokens and whether it is TGI's."""
    tgi = "text" not in body and "inputs" in body
    prompt = body.get("inputs" if tgi else "text")
    if not isinstance(prompt, str):
        raise Rejected("/generate needs a string `text` (SGLang) or `inputs` (TGI)")
    params = body.get("parameters" if tgi else "sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise Rejected("parameters / sampling_params must be an object")
    limit = positive_int(params.get("max_new_tokens"), default_max_tokens, "max_new_tokens")
    return encode_text(prompt), limit, tgi


def full_text(seq: Sequence) -> str:
    return answer_text(seq.generated)


def usage(seqs: list[Sequence]) -> Json:
    prompt = sum(seq.prompt_tokens for seq in seqs)
    completion = sum(seq.generated for seq in seqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(seq.cached_tokens for seq in seqs)},
    }


def _finish(seq: Sequence, position: int) -> str | None:
    return "length" if position + 1 == seq.max_tokens else None


class Format:
    """How one endpoint answers: its stream events per token, its stream tail, its body."""

    done_marker = True

    def __init__(self, ident: str, model: str, include_usage: bool = False) -> None:
        self.ident, self.model, self.include_usage = ident, model, include_usage
        self.created = int(time.time())

    def events(self, index: int, seq: Sequence, position: int) -> list[Json]:
        raise NotImplementedError

    def body(self, seqs: list[Sequence]) -> Json:
        raise NotImplementedError

    def tail(self, seqs: list[Sequence]) -> list[Json]:
        return []

    def _head(self, kind: str, choices: list[Json]) -> Json:
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


class CompletionFormat(Format):
    def events(self, index: int, seq: Sequence, position: int) -> list[Json]:
        text = token_text(position)
        choice = {"index": index, "text": text, "logprobs": None}
        return [self._head("text_completion", [choice | {"finish_reason": _finish(seq, position)}])]

    def body(self, seqs: list[Sequence]) -> Json:
        choices = [
            {"index": i, "text": full_text(seq), "logprobs": None, "finish_reason": "length"}
            for i, seq in enumerate(seqs)
        ]
        return self._head("text_completion", choices) | {"usage": usage(seqs)}

    def tail(self, seqs: list[Sequence]) -> list[Json]:
        return (
            [self._head("text_completion", []) | {"usage": usage(seqs)}]
            if self.include_usage
            else []
        )


class ChatFormat(Format):
    def events(self, index: int, seq: Sequence, position: int) -> list[Json]:
        deltas: list[tuple[Json, str | None]] = []
        if position == 0:  # OpenAI's first chunk names the role; sent with the first token
            deltas.append(({"role": "assistant", "content": ""}, None))
        deltas.append(({"content": token_text(position)}, _finish(seq, position)))
        return [
            self._head("chat.completion.chunk", [_choice(index, delta, finish)])
            for delta, finish in deltas
        ]

    def body(self, seqs: list[Sequence]) -> Json:
        message = {"role": "assistant", "content": full_text(seqs[0])}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        return self._head("chat.completion", [choice]) | {"usage": usage(seqs)}

    def tail(self, seqs: list[Sequence]) -> list[Json]:
        if not self.include_usage:
            return []
        return [self._head("chat.completion.chunk", []) | {"usage": usage(seqs)}]


def _choice(index: int, delta: Json, finish: str | None) -> Json:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


class SGLangFormat(Format):
    """SGLang's ``/generate``: every event carries the text so far and ``meta_info``."""

    def events(self, index: int, seq: Sequence, position: int) -> list[Json]:
        text = answer_text(position + 1)
        return [{"text": text, "meta_info": self._meta(seq, position + 1), "index": index}]

    def body(self, seqs: list[Sequence]) -> Json:
        return {"text": full_text(seqs[0]), "meta_info": self._meta(seqs[0], seqs[0].generated)}

    def _meta(self, seq: Sequence, generated: int) -> Json:
        done = generated == seq.max_tokens
        return {
            "id": self.ident,
            "prompt_tokens": seq.prompt_tokens,
            "completion_tokens": generated,
            "cached_tokens": seq.cached_tokens,
            "finish_reason": {"type": "length", "length": generated} if done else None,
        }


class TGIFormat(Format):
    """TGI's ``/generate`` and ``/generate_stream``: token events, no ``[DONE]``."""

    done_marker = False

    def events(self, index: int, seq: Sequence, position: int) -> list[Json]:
        last = position + 1 == seq.max_tokens
        token = {"id": position, "text": token_text(position), "logprob": 0.0, "special": False}
        return [
            {
                "index": position,
                "token": token,
                "generated_text": answer_text(position + 1) if last else None,
                "details": self._details(seq) if last else None,
            }
        ]

    def body(self, seqs: list[Sequence]) -> Json:
        return {"generated_text": full_text(seqs[0]), "details": self._details(seqs[0])}

    def _details(self, seq: Sequence) -> Json:
        return {"finish_reason": "length", "generated_tokens": seq.max_tokens, "seed": None}
