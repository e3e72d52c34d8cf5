"""A fake vLLM OpenAI API server behind the fence (shared by the fence and authz tests)."""

from __future__ import annotations

import asyncio
import json


class FakeVllm:
    """Raw ASGI stand-in for vLLM's app: records each path it served; ``/v1/completions`` streams
    two SSE chunks, the second only once :attr:`release` is set (an in-flight streaming request);
    every other path answers ``{"vllm": path}`` (``/pause`` and ``/resume`` as vLLM's dev routes)."""

    def __init__(self) -> None:
        self.served: list[str] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.block = False

    async def __call__(self, scope, receive, send):
        self.served.append(scope["path"])
        if scope["path"] == "/v1/completions":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b'data: {"n": 1}\n\n', "more_body": True})
            self.started.set()
            if self.block:
                await self.release.wait()
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        body = json.dumps({"vllm": scope["path"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
