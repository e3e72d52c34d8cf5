"""Continuous batching for the lab engine: a bounded running set, a FIFO waiting queue, chunked
prefill and a KV-token budget (vLLM's scheduler in miniature).

Each engine step the scheduler admits waiting requests in FIFO order while the running set has
room (``max_running``) and the KV budget holds their reservation (``prompt + max_tokens +
speculation depth + 1`` tokens, reserved whole at admission, so an admitted request can always
finish), then plans the step: every decoding request gets its pending token (plus drafts when
speculating), then prefilling requests get prompt chunks in admission order until
``max_step_tokens`` new tokens are planned (at least one chunk per step).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsv41.engine.sampler import SamplingParams
from dsv41.errors import Dsv41Error

_ids = itertools.count()


class RequestError(Dsv41Error):
    """A request the engine cannot take (too long, bad ids): HTTP 400."""


@dataclass(eq=False)  # identity semantics: `r in running` must not compare prompts field by field
class Request:
    """One generation request as the engine tracks it.

    ``prompt``: raw ids; ``params``: sampling; ``sink(event: dict)``: called from the engine
    thread for every step that emits tokens (``{"type": "tokens", "ids": [...]}``), then once
    with ``{"type": "finish", "reason": "stop"|"length"|"abort"|"error", ...}``.
    """

    prompt: list[int]
    params: SamplingParams
    sink: Callable[[dict], None]
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    fed: int = 0  # prompt tokens already in the cache
    pending: int | None = None  # sampled token the target has not consumed yet
    last_hidden: Any = None  # float32[H] tap at the position that produced `pending`
    cache: Any = None
    gen: Any = None  # torch.Generator, seeded per request
    sample_seed: int | None = None  # the seed `gen` got (params.seed, or a random one)
    first_token_at: float | None = None
    last_token_at: float | None = None  # time of the latest step that emitted tokens (ITL)
    finished: str | None = None
    reserved: int = 0
    drafts: list[int] = field(default_factory=list)
    proposal: Any = None

    @property
    def prefilling(self) -> bool:
        """True while prompt tokens remain to be fed into the KV cache."""
        return self.fed < len(self.prompt)


@dataclass
class StepPlan:
    """``items``: (request, tokens to feed, positions whose logits are needed)."""

    items: list[tuple[Request, list[int], list[int]]]


class Scheduler:
    """FIFO admission + step planning. Thread-safe ``add``/``abort_all``; ``plan`` runs in the
    engine thread.

    ``kv_cache_tokens``: total KV tokens the engine may hold; ``max_model_len``: longest single
    request (prompt + max_tokens); ``max_running``: running-set bound; ``max_step_tokens``: new
    tokens per step (prefill chunk budget); ``spec_depth``: drafts per round (reserved per request).
    """

    def __init__(
        self,
        kv_cache_tokens: int,
        max_model_len: int,
        max_running: int = 8,
        max_step_tokens: int = 512,
        spec_depth: int = 0,
    ) -> None:
        if kv_cache_tokens < 16:
            raise Dsv41Error(f"--kv-cache-tokens must be >= 16, got {kv_cache_tokens}")
        if max_running < 1 or max_step_tokens < 1:
            raise Dsv41Error("max_running and max_step_tokens must be >= 1")
        self.kv_cache_tokens = kv_cache_tokens
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.spec_depth = spec_depth
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.reserved = 0
        self.lock = threading.Lock()

    def reservation(self, r: Request) -> int:
        """KV tokens reserved for ``r`` at admission: prompt + max_tokens + spec depth + 1."""
        return len(r.prompt) + r.params.max_tokens + self.spec_depth + 1

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ``RequestError`` (one clear line) when a request can never run."""
        if prompt_len < 1:
            raise RequestError("the prompt is empty")
        need = prompt_len + max_tokens
        limit = min(self.max_model_len, self.kv_cache_tokens - self.spec_depth - 1)
        if need > limit:
            raise RequestError(
                f"this request needs {need} tokens (prompt {prompt_len} + max_tokens {max_tokens}) "
                f"but the engine holds at most {limit} per request (--kv-cache-tokens "
                f"{self.kv_cache_tokens}, max_position_embeddings {self.max_model_len})"
            )

    def add(self, r: Request) -> None:
        """Append ``r`` to the waiting queue (any thread); ``RequestError`` when it can never run."""
        self.check(len(r.prompt), r.params.max_tokens)
        with self.lock:
            self.waiting.append(r)

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self.lock:
            return len(self.running), len(self.waiting)

    def idle(self) -> bool:
        """True when nothing is running or waiting."""
        with self.lock:
            return not self.running and not self.waiting

    def admit(self) -> list[Request]:
        """Move waiting requests into the running set (FIFO, budget permitting)."""
        new = []
        with self.lock:
            while self.waiting and len(self.running) < self.max_running:
                r = self.waiting[0]
                need = self.reservation(r)
                if self.reserved + need > self.kv_cache_tokens:
                    break  # FIFO: no overtaking, the head waits for KV space
                self.waiting.popleft()
                r.reserved = need
                self.reserved += need
                self.running.append(r)
                new.append(r)
        return new

    def release(self, r: Request) -> None:
        """Drop a finished request from the running set and free its reservation."""
        with self.lock:
            if r in self.running:
                self.running.remove(r)
                self.reserved -= r.reserved
            elif r in self.waiting:
                self.waiting.remove(r)

    def take_waiting(self) -> list[Request]:
        """Remove and return every waiting request (abort)."""
        with self.lock:
            out = list(self.waiting)
            self.waiting.clear()
            return out

    def plan(self) -> StepPlan:
        """The next step's work (see module doc). Decode items feed ``[pending] + drafts``."""
        items = []
        budget = self.max_step_tokens
        with self.lock:
            running = list(self.running)
        for r in running:
            if not r.prefilling and r.pending is not None and r.finished is None:
                toks = [r.pending] + list(r.drafts)
                items.append((r, toks, list(range(len(toks)))))
                budget -= len(toks)
        first = True
        for r in running:
            if r.prefilling and r.finished is None and (budget > 0 or first):
                n = min(len(r.prompt) - r.fed, max(budget, 1) if not first else max(budget, 16))
                chunk = r.prompt[r.fed : r.fed + n]
                done = r.fed + n == len(r.prompt)
                items.append((r, chunk, [n - 1] if done else []))
                budget -= n
                first = False
        return StepPlan(items)
