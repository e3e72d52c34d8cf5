"""The OpenAI-compatible API's protocol: request validation, response and stream-chunk bodies,
and the error shape (the part of vLLM's ``entrypoints/openai/protocol.py`` this engine serves).

The route handlers (``dsv41.engine.api_router``) call :func:`parse_completion_request` on a decoded
body before admission, so every client mistake is a 400 naming the field (``param``) before the
engine sees anything; :class:`Reply` shapes the answer (``text_completion`` /
``chat.completion`` objects, their ``*.chunk`` stream chunks, ``usage``).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`).
Every other field of the OpenAI/vLLM request schemas is refused with a 400 naming it unless it
asks for nothing (``dsv41.engine.request_fields``).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from dsv41 import fileio
from dsv41.engine import request_fields
from dsv41.engine.sampler import SamplingParams
from dsv41.errors import Dsv41Error
from dsv41.tokenizer import VOCAB_SIZE, ByteTokenizer


class ApiError(Exception):
    """An error answered to the client: ``status`` code, ``message``, OpenAI error ``type``,
    ``param`` (the field at fault), ``close`` (answer with ``Connection: close``)."""

    def __init__(
        self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None, close: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.etype, self.param, self.close = status, message, etype, param, close


def error_body(status: int, message: str, etype: str, param: str | None = None) -> dict:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` (``code``: the
    HTTP status), as answered by every error response and sent as a stream's last event."""
    return {"error": {"message": message, "type": etype, "param": param, "code": status}}


#: ``Retry-After`` (seconds) of every 429 and 503 the API answers: the request may succeed later
#: (load shed, paused, draining, a failed engine about to be restarted).
RETRY_AFTER_S = 1


def error_response(e: ApiError) -> JSONResponse:
    """The OpenAI-shaped JSON error response of ``e`` (``Connection: close`` when ``e.close``;
    ``Retry-After`` on a 429 or 503)."""
    headers = {"connection": "close"} if e.close else {}
    if e.status in (429, 503):
        headers["retry-after"] = str(RETRY_AFTER_S)
    return JSONResponse(
        status_code=e.status, headers=headers or None, content=error_body(e.status, e.message, e.etype, e.param)
    )


def _show(v, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters, for error messages that echo a client's value."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class BigInt:
    """A JSON integer longer than Python's int-parsing limit (``sys.get_int_max_str_digits()``):
    kept as its digit count so the field's own check refuses it with the field's name."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str):
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
    return BigInt(text) if limit and len(text) > limit else int(text)


def _bad_text(obj) -> str | None:
    """The path of the first string (value or key) in ``obj`` holding a lone UTF-16 surrogate
    (JSON allows ``"\ud800"``; it is not Unicode text and cannot be encoded back), else None."""
    stack = [(obj, "")]
    while stack:
        o, path = stack.pop()
        if isinstance(o, str):
            if not o.isascii():
                try:
                    o.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(o, dict):
            for k, v in o.items():
                p = f"{path}.{k}" if path else str(k)
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return path or "body"
                stack.append((v, p))
        elif isinstance(o, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(o))
    return None


def _bool(body: dict, key: str, default: bool = False) -> bool:
    """``body[key]`` as a JSON boolean (``default`` when absent/null); ``ApiError`` 400 otherwise."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean, got {_show(v)}", param=key)
    return v


def parse_json_body(raw: bytes):
    """Decode a request body; ``ApiError`` 400 on anything that is not JSON text (bad UTF-8,
    syntax, nesting deep enough to hit Python's recursion limit, strings with lone surrogates,
    naming the field). Integers beyond Python's int-parsing limit become ``BigInt`` (the field's
    own check refuses them by name)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # any other literal Python refuses to convert
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    bad = _bad_text(body)
    if bad is not None:
        raise ApiError(400, f"{bad}: a string holds a lone UTF-16 surrogate (not valid Unicode)", param=bad)
    return body


def _int(body: dict, key: str, default, lo: int | None = None, hi: int | None = None):
    """``body[key]`` as an int in [lo, hi] (``default`` when absent/null); ``ApiError`` 400 otherwise
    (floats, strings and booleans are refused, as OpenAI's schema types them as integers)."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, BigInt):
        raise ApiError(400, f"{key} must be an integer in range, got {v!r}", param=key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, got {_show(v)}", param=key)
    if lo is not None and v < lo:
        raise ApiError(400, f"{key} must be >= {lo}, got {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(400, f"{key} must be <= {hi}, got {v}", param=key)
    return v


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    """``body[key]`` as a finite float in [lo, hi] (or (lo, hi] with ``lo_open``); ``ApiError`` 400
    otherwise (NaN, strings, booleans, integers beyond float range)."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{key} must be a number, got {_show(v)}", param=key)
    try:
        v = float(v)
    except OverflowError:  # a JSON integer beyond float range, e.g. 10**400
        raise ApiError(
            400, f"{key} must be in [{lo}, {hi}], got an integer of {len(str(v))} digits", param=key
        ) from None
    if v != v or v > hi or v < lo or (lo_open and v <= lo):
        raise ApiError(400, f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=key)
    return v


def parse_sampling(body: dict, default_max_tokens: int, chat: bool) -> SamplingParams:
    """Validate the sampling fields of a request body; raises ``ApiError`` (400)."""
    if _int(body, "n", 1) != 1:
        raise ApiError(400, "n must be 1 (the lab engine returns one choice)", param="n")
    if _int(body, "best_of", 1) != 1:
        raise ApiError(400, "best_of is not supported", param="best_of")
    # Every field of the OpenAI/vLLM schemas is implemented, metadata, or refused unless it asks
    # for nothing (engine/request_fields.py; docs/engine.md "Request fields"): none is ignored.
    refused = request_fields.check(body, chat, _show)
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= 1024):
        raise ApiError(
            400, f"cache_salt must be a string of 1 to 1024 characters, got {_show(salt)}", param="cache_salt"
        )
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, key, default_max_tokens, lo=0)
    min_tokens = _int(body, "min_tokens", 0, lo=0)
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    seed = _int(body, "seed", None)
    ignore_eos = _bool(body, "ignore_eos")
    top_k = _int(body, "top_k", 0, lo=-1, hi=VOCAB_SIZE)  # vLLM: 0 or -1 disables top-k
    return SamplingParams(
        temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        top_k=max(0, top_k),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
    )


def parse_prompt(body: dict, tok: ByteTokenizer, max_len: int | None = None) -> list[int]:
    """``prompt``: a string, a list of token ids, or a one-element list of either -> raw ids.

    ``max_len``: when given, a prompt that cannot fit (more characters or ids than ``max_len``;
    every character is at least one byte token) is refused before tokenizing. Raises ``ApiError``
    400 for an empty, too long or malformed prompt and for ids outside ``[0, VOCAB_SIZE)``.
    """
    p = body.get("prompt")
    if isinstance(p, BigInt) or (isinstance(p, list) and any(isinstance(t, BigInt) for t in p)):
        raise ApiError(
            400,
            "prompt token ids must be integers in [0, {VOCAB_SIZE})".replace("{VOCAB_SIZE}", str(VOCAB_SIZE)),
            param="prompt",
        )
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if max_len is not None and isinstance(p, (str, list)) and len(p) > max_len:
        raise ApiError(
            400,
            f"the prompt has {len(p)} {'characters' if isinstance(p, str) else 'tokens'}, "
            f"but the engine holds at most {max_len} tokens per request",
            param="prompt",
        )
    if isinstance(p, str):
        ids = tok.encode(p)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})", param="prompt")
        ids = list(p)
    elif isinstance(p, list):
        raise ApiError(
            400,
            "prompt must be a string, a list of token ids, or a one-element list of those "
            "(batched prompts are not supported)",
            param="prompt",
        )
    else:
        raise ApiError(400, "prompt is required (a string or a list of token ids)", param="prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    return ids


def _stream_options(body: dict) -> tuple[bool, bool]:
    """(``include_usage``, ``continuous_usage_stats``) of ``stream_options``; ``ApiError`` 400
    when it is not an object or is given without ``stream=true``."""
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not isinstance(so, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if so and not body.get("stream"):
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    return _bool(so, "include_usage"), _bool(so, "continuous_usage_stats")


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions (``chat`` False) or chat completions request: ``prompt_ids``
    (token ids, int, after the chat template for chat), ``params`` (sampling), ``stream``,
    ``include_usage`` / ``continuous_usage`` (``stream_options``), ``return_token_ids``."""

    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool


def parse_completion_request(body: dict, tok: ByteTokenizer, max_model_len: int, chat: bool) -> CompletionRequest:
    """Validate a decoded request body (a dict) of ``/v1/completions`` or ``/v1/chat/completions``.

    ``max_model_len``: tokens one request may hold (a longer completions prompt is refused before
    tokenizing). Default ``max_tokens``: 16 for completions (OpenAI's), for chat what is left of
    ``max_model_len`` after the prompt, at most 256. Raises ``ApiError`` 400 naming the field.
    """
    stream = _bool(body, "stream")
    include_usage, continuous = _stream_options(body)
    rti = _bool(body, "return_token_ids")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        try:
            ids = tok.chat_prompt(msgs)
        except Dsv41Error as exc:
            raise ApiError(400, str(exc), param="messages") from None
        default_max = max(1, min(256, max_model_len - len(ids)))
    else:
        ids = parse_prompt(body, tok, max_model_len)
        default_max = 16
    params = parse_sampling(body, default_max, chat)
    return CompletionRequest(chat, ids, params, stream, include_usage, continuous, rti)


def usage(ev: dict) -> dict:
    """OpenAI's ``usage`` of a request from an engine event's ``prompt_tokens`` and
    ``completion_tokens`` (token counts)."""
    return {
        "prompt_tokens": ev["prompt_tokens"],
        "completion_tokens": ev["completion_tokens"],
        "total_tokens": ev["prompt_tokens"] + ev["completion_tokens"],
    }


def sse(d: dict) -> str:
    """One server-sent event carrying ``d`` as JSON."""
    return f"data: {fileio.dumps_json(d)}\n\n"


@dataclass(frozen=True)
class Reply:
    """The answer to one :class:`CompletionRequest`: ``id`` (``cmpl-`` or ``chatcmpl-`` and 24
    hex digits), ``created`` (Unix time, s) and ``model``; builds the whole response, the
    stream's chunks and its usage chunk (OpenAI's objects, vLLM's ``token_ids`` fields)."""

    req: CompletionRequest
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, req: CompletionRequest, model: str) -> Reply:
        """A fresh id, created now."""
        return cls(req, ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), model)

    @property
    def chunk_object(self) -> str:
        """The ``object`` of a stream chunk."""
        return "chat.completion.chunk" if self.req.chat else "text_completion"

    def body(self, text: str, out: list[int], ev: dict) -> dict:
        """The non-streaming response: ``text`` decoded from the generated ids ``out``; ``ev``:
        the engine's finish event (``reason``, token counts)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": ev["reason"], "logprobs": None}
        if self.req.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.req.return_token_ids:
            choice["token_ids"] = out
            choice["prompt_token_ids"] = self.req.prompt_ids
        return {
            "id": self.id,
            "object": "chat.completion" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(ev),
        }

    def chunk(self, text: str | None, tids: list[int] | None, finish: str | None, ev: dict | None, first: bool) -> dict:
        """One stream chunk: ``text`` (None: no content), the ids it decodes ``tids`` (sent with
        ``return_token_ids``), ``finish`` reason (last chunk), ``ev`` (usage with
        ``continuous_usage_stats``), ``first`` (the chat role and the prompt ids ride on it)."""
        if self.req.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if self.req.return_token_ids and tids is not None:
            c["token_ids"] = tids
            if first:
                c["prompt_token_ids"] = self.req.prompt_ids
        d: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [c],
        }
        if self.req.include_usage and self.req.continuous_usage and ev is not None:
            d["usage"] = usage(ev)
        return d

    def usage_chunk(self, ev: dict) -> dict:
        """The stream's usage chunk (``include_usage``): no choices."""
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(ev),
        }
