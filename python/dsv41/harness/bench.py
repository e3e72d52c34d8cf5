"""Bench client: streamed requests to any OpenAI-compatible endpoint, timed from the client side.

Per request (``RequestResult``): TTFT (request sent -> first SSE chunk carrying tokens), ``step_ms``
(gaps between consecutive token-bearing SSE chunks: with vLLM and the lab engine one chunk is one
engine step, so under speculation one gap is one verify step that may carry several tokens), tokens
per step (decode tokens counted from ``usage`` / ``token_ids``, never from chunk counts, divided by
decode steps), decode tok/s (decode tokens over first -> last chunk), end-to-end time, finish
reason and errors. Every request carries its own ``seed``, ``min_tokens = max_tokens`` (fixed
length, so arms compare equal work), and a unique ``cache_salt`` (vLLM's per-request prefix-cache
isolation; optionally a unique prompt prefix for endpoints without it), so prefix caching cannot
inflate a cell.

Around a set of requests, ``snapshot_metrics`` reads every rank's Prometheus ``/metrics``
(``prometheus_client.parser``) and ``metrics_delta`` gives the counter deltas (Engram lookups /
fallbacks per rank, drafter rounds / accepted, ``vllm:spec_decode_*``, TTFT / e2e / inter-token
histogram ``_sum`` / ``_count``).

Before anything is timed, ``smoke`` runs a canary (finite, non-empty output) and a known-answer
greedy prompt (the first greedy reference prompt: equal to the recorded ids when a refs file is
given, else identical on two runs).

Workloads: a JSON spec (``schemas/bench_spec.schema.json``) from ``--spec``, else
``DSV41_BENCH_SPEC_FILE``, else the public-safe default shipped in ``dsv41/data/bench_spec.json``.
The six greedy reference prompts come from ``DSV41_GREEDY_PROMPTS_FILE`` when set (a JSON list of
``{"name", "prompt"}``), else ``dsv41.harness.refs.PROMPTS``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsv41 import envs, fileio
from dsv41.errors import Dsv41Error
from dsv41.harness import http

SPEC_FORMAT = "dsv41-bench-spec/1"
DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "data" / "bench_spec.json"
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "bench_spec.schema.json"

# Public-domain-style filler vocabulary of the seeded prompt generator (no real prompt text).
_WORDS = (
    "table row server lookup engram layer token draft verify step round cache page batch rank "
    "link memory host spark node proxy worker window cell block seed prompt budget metric the a of "
    "and to in is on for with every each one two three five green quick lamp hill river stone"
).split()


class BenchError(Dsv41Error):
    """A spec, endpoint or smoke check the bench cannot proceed with."""


class BenchAborted(BenchError):
    """The run was interrupted (Ctrl-C) or a smoke check failed: treat as a failed window."""


def _env_spec_file(env: Mapping[str, str] | None = None) -> str | None:
    return envs.parse(env).bench_spec_file or None


def _env_greedy_prompts_file(env: Mapping[str, str] | None = None) -> str | None:
    return envs.parse(env).greedy_prompts_file or None


def _read_json(path: str | os.PathLike, what: str) -> Any:
    from dsv41 import fileio

    return fileio.read_json(path, what, error=BenchError)


def load_spec(path: str | None = None, env: Mapping[str, str] | None = None) -> dict:
    """The workload spec: ``path``, else ``DSV41_BENCH_SPEC_FILE``, else the shipped default.

    Returns the validated document with defaults filled in (``sampler``, ``concurrency`` 1,
    ``repeats`` 1, ``blocks_per_prompt`` 4, ``seed`` 0, ``timeout_s`` 300, ``cache_salt`` true,
    ``unique_prefix`` false) and ``source`` (where it came from). Raises BenchError naming the
    file and the failing JSON path.
    """
    import jsonschema

    src = path or _env_spec_file(env) or str(DEFAULT_SPEC)
    doc = _read_json(src, "bench spec")
    schema = fileio.loads_json(SCHEMA_PATH.read_text())
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if err is not None:
        loc = "/".join(str(x) for x in err.absolute_path) or "(top)"
        raise BenchError(f"bench spec {src} fails its schema at {loc}: {err.message}")
    ids = [p["id"] for p in doc["prompts"]]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise BenchError(f"bench spec {src}: prompt id {dup[0]} appears more than once")
    out = {
        "sampler": {},
        "concurrency": 1,
        "repeats": 1,
        "blocks_per_prompt": 4,
        "seed": 0,
        "timeout_s": 300.0,
        "cache_salt": True,
        "unique_prefix": False,
        "model": None,
    }
    out.update(doc)
    out["sampler"] = {"temperature": 1.0, "top_p": 1.0, **doc.get("sampler", {})}
    out["source"] = src
    return out


def greedy_prompts(env: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """The six greedy reference prompts as ``((name, prompt), ...)``: ``DSV41_GREEDY_PROMPTS_FILE``
    (a JSON list of ``{"name", "prompt"}``, names unique) when set, else the shipped defaults.
    Raises BenchError on an unreadable or malformed file."""
    from dsv41.harness.refs import PROMPTS

    path = _env_greedy_prompts_file(env)
    if not path:
        return PROMPTS
    doc = _read_json(path, "greedy prompts file")
    if (
        not isinstance(doc, list)
        or not doc
        or not all(
            isinstance(p, dict)
            and isinstance(p.get("name"), str)
            and p["name"]
            and isinstance(p.get("prompt"), str)
            and p["prompt"]
            for p in doc
        )
    ):
        raise BenchError(
            f'greedy prompts file {path}: expected a non-empty JSON list of {{"name": str, "prompt": str}}'
        )
    names = [p["name"] for p in doc]
    if len(set(names)) != len(names):
        raise BenchError(f"greedy prompts file {path}: prompt names must be unique")
    return tuple((p["name"], p["prompt"]) for p in doc)


def prompt_text(entry: dict) -> str:
    """The text of one spec prompt: ``text``, or ``generate.words`` words drawn from a fixed
    vocabulary by ``random.Random(generate.seed)`` (same seed, same text, on every host)."""
    if "text" in entry:
        return entry["text"]
    g = entry["generate"]
    rnd = random.Random(g["seed"])
    return " ".join(rnd.choice(_WORDS) for _ in range(g["words"]))


@dataclass
class RequestResult:
    """One streamed request, client-side timing (``time.perf_counter``, milliseconds).

    ``steps``: token-bearing chunks (the first one is the prefill step); ``step_ms``: the gaps
    between them (len ``steps - 1``); ``completion_tokens`` from the final ``usage`` (or the sum of
    ``token_ids``); ``tokens_per_step``: decode tokens / decode steps; ``tok_s``: decode tokens
    per second between the first and the last token chunk. ``ok`` False with ``error`` set on an
    HTTP error, an error event, a stream without tokens or a timeout.
    """

    prompt_id: str
    category: str
    seed: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)
    step_ms_p50: float | None = None
    steps: int = 0
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    tokens_per_step: float | None = None
    tok_s: float | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    started_at: float | None = None

    def to_dict(self, keep_ids: bool = False, keep_steps: bool = True) -> dict:
        d = asdict(self)
        if not keep_ids:
            d.pop("token_ids")
        if not keep_steps:
            d.pop("step_ms")
        return d


def _client(timeout_s: float, endpoint: str):
    """An ``httpx.Client`` for requests to ``endpoint``, checked first (``http.check_url``)."""
    import httpx

    http.check_url(endpoint, what=f"endpoint {endpoint}", error=BenchError)

    return httpx.Client(
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        trust_env=False,
        headers={**http.window_headers(), **http.auth_headers(what=f"endpoint {endpoint}", error=BenchError)},
    )


def served_model(endpoint: str, timeout_s: float = 10.0) -> str:
    """First model id of ``GET /v1/models`` (``refs.served_model``); a Dsv41Error naming the
    endpoint when it is unreachable or lists no model."""
    from dsv41.harness.refs import served_model as _served

    return _served(endpoint, timeout_s)


def request_body(model: str, prompt: str, seed: int, max_tokens: int, sampler: dict, salt: str | None) -> dict:
    """The streamed ``/v1/completions`` body of one timed request (vLLM field names)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": sampler.get("temperature", 1.0),
        "top_p": sampler.get("top_p", 1.0),
    }
    if salt:
        body["cache_salt"] = salt
    return body


def stream_one(
    client, endpoint: str, body: dict, prompt_id: str, category: str, clock: Callable[[], float] = time.perf_counter
) -> RequestResult:
    """Send one streamed completion with ``client`` (an ``httpx.Client``) and time it.

    Never raises for a failed request (``ok`` False, ``error`` set); KeyboardInterrupt propagates.
    """
    import httpx

    res = RequestResult(prompt_id, category, int(body.get("seed", 0)), int(body["max_tokens"]))
    times: list[float] = []
    per_chunk: list[int | None] = []
    ids: list[int] = []
    last_usage: dict | None = None
    prev_completion = 0
    t0 = clock()
    res.started_at = time.time()
    try:
        with client.stream("POST", endpoint.rstrip("/") + "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                text = r.read().decode("utf-8", "replace")
                try:
                    text = fileio.loads_json(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {r.status_code}: {str(text)[:300]}"
                return res
            for line in r.iter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    ev = fileio.loads_json(data)
                except ValueError:
                    res.error = f"bad SSE data: {data[:120]}"
                    return res
                if "error" in ev:
                    err = ev["error"]
                    res.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                usage = ev.get("usage")
                for ch in ev.get("choices") or []:
                    tids = ch.get("token_ids")
                    n = None
                    if isinstance(tids, list):
                        n = len(tids)
                        ids.extend(tids)
                    elif isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        n = usage["completion_tokens"] - prev_completion
                    if n or (n is None and ch.get("text")):
                        times.append(now)
                        per_chunk.append(n)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                if isinstance(usage, dict):
                    last_usage = usage
                    if isinstance(usage.get("completion_tokens"), int):
                        prev_completion = usage["completion_tokens"]
    except httpx.TimeoutException as exc:
        res.error = f"timeout: {type(exc).__name__}"
        return res
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    t_end = clock()
    res.e2e_ms = (t_end - t0) * 1e3
    res.token_ids = ids or None
    if last_usage:
        res.completion_tokens = last_usage.get("completion_tokens")
        res.prompt_tokens = last_usage.get("prompt_tokens")
    elif ids:
        res.completion_tokens = len(ids)
    if not times:
        res.error = "the stream carried no tokens"
        return res
    res.steps = len(times)
    res.ttft_ms = (times[0] - t0) * 1e3
    res.step_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
    if res.step_ms:
        res.step_ms_p50 = float(statistics.median(res.step_ms))
    first = per_chunk[0] if per_chunk[0] is not None else 1
    if isinstance(res.completion_tokens, int) and res.steps > 1:
        decode = res.completion_tokens - first
        res.tokens_per_step = decode / (res.steps - 1)
        dt = times[-1] - times[0]
        res.tok_s = decode / dt if dt > 0 else None
    if res.finish_reason is None:
        res.error = "the stream ended without a finish_reason"
        return res
    res.ok = True
    return res


# ---- /metrics snapshots -----------------------------------------------------------------------


def _cumulative(samples) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in samples:
        # counters (``_total``, the speculator's too) and histogram / summary ``_sum`` / ``_count``
        if not name.endswith(("_total", "_sum", "_count")):
            continue
        lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "model_name")
        out[f"{name}{{{lab}}}" if lab else name] = value
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{series: value}`` of the cumulative series (counters, histogram and
    summary ``_sum``/``_count``); ``series`` is ``name{label="v",...}`` with labels sorted and
    ``model_name`` dropped. Parsed by ``harness.http.metric_samples`` (prometheus_client);
    BenchError on text it cannot parse."""
    from dsv41.harness import http

    return _cumulative(http.metric_samples(text, what="cannot parse Prometheus text", error=BenchError))


def snapshot_metrics(urls: Iterable[str], timeout_s: float = 10.0) -> dict[str, dict[str, float]]:
    """``{url: parse_metrics(GET url)}`` for every rank's metrics URL; BenchError when one fails."""
    from dsv41.harness import http

    return {u: _cumulative(http.get_metrics(u, timeout_s=timeout_s, error=BenchError)) for u in urls}


def metrics_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per URL and series: after - before (a series new in ``after`` counts from 0); series whose
    delta is 0 are kept, so a counter that should have moved is visibly 0."""
    return {u: {k: v - before.get(u, {}).get(k, 0.0) for k, v in sorted(vals.items())} for u, vals in after.items()}


# ---- smoke start ------------------------------------------------------------------------------


def smoke(
    endpoint: str,
    model: str,
    refs_doc: dict | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> dict:
    """Correctness before timing: a canary and a known-answer greedy prompt.

    Canary: a short sampled streamed request that must finish with non-empty token ids and
    finite timings. Known answer: the first greedy prompt (``refs_doc``'s first prompt, else
    :func:`greedy_prompts`' first) at temperature 0, compared with the recorded ids, or with a
    second run when no refs are given. Returns ``{"canary": {...}, "greedy": {...}}``; raises
    BenchAborted naming what failed.
    """
    from dsv41.harness.refs import first_diff

    with _client(timeout_s, endpoint) as c:
        canary = stream_one(
            c,
            endpoint,
            request_body(model, "The canary sings", 1, 8, {"temperature": 1.0}, uuid.uuid4().hex),
            "canary",
            "smoke",
        )
    if (
        not canary.ok
        or not canary.token_ids
        or not all(math.isfinite(v) for v in (canary.ttft_ms or math.nan, canary.e2e_ms or math.nan))
    ):
        raise BenchAborted(f"smoke: canary request failed: {canary.error or 'empty or non-finite output'}")
    if refs_doc:
        p = refs_doc["prompts"][0]
        name, prompt, want, n = p["name"], p["prompt"], list(p["token_ids"]), int(refs_doc["max_tokens"])
    else:
        name, prompt = greedy_prompts(env)[0]
        want, n = None, 16
    runs = []
    for _ in range(1 if want is not None else 2):
        with _client(timeout_s, endpoint) as c:
            g = stream_one(
                c, endpoint, request_body(model, prompt, 0, n, {"temperature": 0.0}, uuid.uuid4().hex), name, "smoke"
            )
        if not g.ok:
            raise BenchAborted(f"smoke: greedy prompt {name} failed: {g.error}")
        runs.append(g.token_ids or [])
    ref = want if want is not None else runs[0]
    diff = first_diff(ref, runs[-1])
    if diff is not None:
        raise BenchAborted(
            f"smoke: greedy prompt {name} differs from its "
            f"{'recorded reference' if want is not None else 'first run'} at token {diff}"
        )
    return {
        "canary": {"tokens": len(canary.token_ids), "ttft_ms": canary.ttft_ms},
        "greedy": {"prompt": name, "tokens": len(runs[-1]), "against": "refs" if want is not None else "repeat"},
    }


# ---- a run --------------------------------------------------------------------------------------


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread, so a run stopped by
    a service manager or a playbook is handled exactly like Ctrl-C (partial results kept, exit
    non-zero); the previous handler is restored after."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise KeyboardInterrupt

    prev = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


def plan_requests(spec: dict, salt_base: str) -> list[dict]:
    """The requests of ``dsv41 bench run``: every prompt ``repeats`` times, seed
    ``spec.seed + index``, interleaved by repeat (prompt order within a repeat). Each item:
    ``{"prompt_id", "category", "seed", "max_tokens", "prompt", "salt"}``."""
    out = []
    i = 0
    for _rep in range(spec["repeats"]):
        for p in spec["prompts"]:
            text = prompt_text(p)
            salt = f"{salt_base}-{i}"
            if spec["unique_prefix"]:
                text = f"[{salt}] {text}"
            out.append(
                {
                    "prompt_id": p["id"],
                    "category": p["category"],
                    "seed": spec["seed"] + i,
                    "max_tokens": p.get("max_tokens", spec["max_tokens"]),
                    "prompt": text,
                    "salt": salt if spec["cache_salt"] else None,
                }
            )
            i += 1
    return out


def run_requests(
    endpoint: str,
    model: str,
    items: list[dict],
    sampler: dict,
    concurrency: int,
    timeout_s: float,
    progress: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Run ``items`` (``plan_requests`` shape) with ``concurrency`` streams; results in item order.

    KeyboardInterrupt stops submitting, waits for nothing more and propagates (the caller
    treats it as a failure)."""
    from concurrent.futures import ThreadPoolExecutor

    results: list[RequestResult | None] = [None] * len(items)
    with _client(timeout_s, endpoint) as c:

        def one(k: int) -> None:
            it = items[k]
            body = request_body(model, it["prompt"], it["seed"], it["max_tokens"], sampler, it["salt"])
            results[k] = stream_one(c, endpoint, body, it["prompt_id"], it["category"])
            if progress:
                progress(results[k])

        if concurrency <= 1:
            for k in range(len(items)):
                one(k)
        else:
            pool = ThreadPoolExecutor(max_workers=concurrency)
            try:
                futs = [pool.submit(one, k) for k in range(len(items))]
                for f in futs:
                    f.result()
            except KeyboardInterrupt:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            pool.shutdown(wait=True)
    return [r for r in results if r is not None]


def summarize(results: list[RequestResult]) -> dict:
    """Per category and overall: requests, failures, p50 of TTFT / per-request step_ms p50 /
    tok/s / tokens per step (ms, tok/s)."""

    def p50(vals):
        vals = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
        return float(statistics.median(vals)) if vals else None

    groups: dict[str, list[RequestResult]] = {"all": list(results)}
    for r in results:
        groups.setdefault(r.category, []).append(r)
    return {
        g: {
            "requests": len(rs),
            "failed": sum(not r.ok for r in rs),
            "ttft_ms_p50": p50(r.ttft_ms for r in rs if r.ok),
            "step_ms_p50": p50(r.step_ms_p50 for r in rs if r.ok),
            "tok_s_p50": p50(r.tok_s for r in rs if r.ok),
            "tokens_per_step_p50": p50(r.tokens_per_step for r in rs if r.ok),
        }
        for g, rs in groups.items()
    }
