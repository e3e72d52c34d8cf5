"""The six greedy reference prompts: record them once, compare every later deploy against them.

A reference is the token ids the serving endpoint generates for one fixed prompt at temperature 0
(greedy). After a restore or a redeploy the same prompts must give the same ids; the first
differing position per prompt says where a mismatch starts (docs/system.md, "Deploy").

Endpoint contract (docs/interfaces.md, engine): OpenAI-compatible ``POST /v1/completions`` with
``temperature: 0`` and ``return_token_ids: true`` returns ``choices[0].token_ids`` (vLLM's field
name); ``GET /v1/models`` lists the served model. Engram counters are read from rank 0's
``/metrics`` (``dsv41_engram_<key>_total{rank="R"}``, keys as ``RowSource.counters()``).

The refs file (JSON): ``{"format": "dsv41-greedy-refs/1", "model": str, "max_tokens": int,
"recorded_at": ISO-8601 UTC, "prompts": [{"name": str, "prompt": str, "token_ids": [int]}]}``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import tempfile
from dataclasses import dataclass, field

from dsv41.errors import Dsv41Error

FORMAT = "dsv41-greedy-refs/1"

# Six prompts that exercise different n-gram statistics (repeats feed the Engram hash with
# recurring 2-4-grams; mixed case / whitespace hit the token map's folding; digits; long words).
PROMPTS: tuple[tuple[str, str], ...] = (
    ("plain", "The table server on the x86 host answers every lookup"),
    ("repeat", "row row row your boat, row row row your boat, row row"),
    ("casefold", "ENGRAM Engram engram\tEnGrAm\nengram"),
    ("digits", "0 1 2 3 5 8 13 21 34 55 89 144 233 377"),
    ("code", "def lookup(rows):\n    return [table[r] for r in rows]\n"),
    ("long", "Speculative decoding drafts five tokens per round and the target verifies them"),
)
DEFAULT_MAX_TOKENS = 16


class RefsError(Dsv41Error):
    """The endpoint or the refs file cannot be used (unreachable, bad JSON, missing field)."""


@dataclass
class PromptResult:
    """Comparison of one prompt: ``first_diff`` is the first differing token position (0-based)
    or None when identical; ``expected``/``got`` are the token id lists."""

    name: str
    expected: list[int]
    got: list[int]
    first_diff: int | None = None

    @property
    def identical(self) -> bool:
        return self.first_diff is None


@dataclass
class Comparison:
    """All prompts: ``identical`` counts prompts with equal ids; ``results`` in prompt order."""

    results: list[PromptResult] = field(default_factory=list)

    @property
    def identical(self) -> int:
        return sum(r.identical for r in self.results)

    @property
    def total(self) -> int:
        return len(self.results)

    def summary(self) -> str:
        """One line: ``6/6 identical`` or ``5/6 identical; repeat differs at 3``."""
        bad = [f"{r.name} differs at {r.first_diff}" for r in self.results if not r.identical]
        return f"{self.identical}/{self.total} identical" + ("; " + ", ".join(bad) if bad else "")

    def to_dict(self) -> dict:
        return {
            "identical": self.identical,
            "total": self.total,
            "prompts": [
                {"name": r.name, "first_diff": r.first_diff, "expected": r.expected, "got": r.got}
                for r in self.results
            ],
        }


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a length difference counts at the shorter
    length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _client(timeout_s: float):
    import httpx

    return httpx.Client(timeout=timeout_s, trust_env=False)


def served_model(endpoint: str, timeout_s: float = 10.0) -> str:
    """The first model id of ``GET {endpoint}/v1/models``; RefsError if none or unreachable."""
    import httpx

    try:
        with _client(timeout_s) as c:
            r = c.get(endpoint.rstrip("/") + "/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RefsError(f"cannot list models at {endpoint}: {exc}") from exc
    if not data or "id" not in data[0]:
        raise RefsError(f"{endpoint}/v1/models lists no model")
    return str(data[0]["id"])


def generate(endpoint: str, prompt: str, model: str, max_tokens: int = DEFAULT_MAX_TOKENS,
             timeout_s: float = 120.0) -> list[int]:
    """Greedy token ids for one prompt (temperature 0, ``max_tokens`` new tokens at most).

    Raises RefsError when unreachable, on HTTP errors, or when the response lacks
    ``choices[0].token_ids``.
    """
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0,
            "return_token_ids": True}
    try:
        with _client(timeout_s) as c:
            r = c.post(endpoint.rstrip("/") + "/v1/completions", json=body)
            r.raise_for_status()
            choice = (r.json().get("choices") or [{}])[0]
    except (httpx.HTTPError, ValueError) as exc:
        raise RefsError(f"completion at {endpoint} failed: {exc}") from exc
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise RefsError(f"{endpoint}/v1/completions returned no choices[0].token_ids (return_token_ids unsupported?)")
    return ids


def run_prompts(endpoint: str, model: str | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                prompts=PROMPTS, timeout_s: float = 120.0) -> dict:
    """Run every prompt greedily; returns a refs document (see module docstring)."""
    model = model or served_model(endpoint)
    return {
        "format": FORMAT,
        "model": model,
        "max_tokens": int(max_tokens),
        "recorded_at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "prompts": [{"name": n, "prompt": p, "token_ids": generate(endpoint, p, model, max_tokens, timeout_s)}
                    for n, p in prompts],
    }


def load_refs(path: str | os.PathLike) -> dict:
    """Read and check a refs file; RefsError naming the file on any problem."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise RefsError(f"cannot read refs {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise RefsError(f"refs {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RefsError(f"refs {path} is not a {FORMAT} file")
    prompts = doc.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("prompt"), str)
        and isinstance(p.get("token_ids"), list) for p in prompts
    ):
        raise RefsError(f"refs {path} has no valid prompts list")
    if not isinstance(doc.get("max_tokens"), int) or doc["max_tokens"] <= 0:
        raise RefsError(f"refs {path} has no valid max_tokens")
    return doc


def save_refs(doc: dict, path: str | os.PathLike) -> None:
    """Write atomically (temp file + rename in the same directory)."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".refs.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def compare(recorded: dict, current: dict) -> Comparison:
    """Compare two refs documents prompt by prompt (by name, in ``recorded`` order).

    A prompt missing from ``current`` counts as differing at position 0.
    """
    got = {p["name"]: p["token_ids"] for p in current["prompts"]}
    out = Comparison()
    for p in recorded["prompts"]:
        g = got.get(p["name"], [])
        out.results.append(PromptResult(p["name"], list(p["token_ids"]), list(g), first_diff(p["token_ids"], g)))
    return out


def verify(endpoint: str, recorded: dict, timeout_s: float = 120.0) -> Comparison:
    """Re-run the recorded prompts (same model name, same max_tokens) and compare."""
    prompts = [(p["name"], p["prompt"]) for p in recorded["prompts"]]
    model = recorded.get("model") or None
    current = run_prompts(endpoint, model, recorded["max_tokens"], prompts, timeout_s)
    return compare(recorded, current)


# ---- Prometheus text: Engram counters per rank on rank 0's /metrics ----------------------------

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text exposition -> [(name, labels, value)]; comments and bad lines skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


def engram_counters(text: str, prefix: str = "dsv41_engram_") -> dict[str, dict[str, float]]:
    """``{rank: {key: value}}`` from metrics named ``<prefix><key>_total{rank="R"}`` (or without
    ``_total``); series without a rank label are ignored."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_metrics(text):
        if not name.startswith(prefix) or "rank" not in labels or name.endswith(("_created", "_bucket")):
            continue
        key = name[len(prefix):]
        key = key[:-6] if key.endswith("_total") else key
        rank = out.setdefault(labels["rank"], {})
        rank[key] = rank.get(key, 0.0) + value
    return out


def fetch_engram_counters(metrics_url: str, prefix: str = "dsv41_engram_", timeout_s: float = 10.0) -> dict:
    """GET ``metrics_url`` and return :func:`engram_counters`; RefsError if unreachable."""
    return engram_counters(fetch_metrics_text(metrics_url, timeout_s), prefix)


def counter_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per rank and key: after - before (keys absent before count from 0)."""
    return {rank: {k: v - before.get(rank, {}).get(k, 0.0) for k, v in keys.items()}
            for rank, keys in after.items()}


def check_remote_engram(delta: dict, ranks: list[str]) -> str | None:
    """None when every rank in ``ranks`` counted lookups and zero fallbacks in ``delta``;
    otherwise one line saying which rank and why."""
    for r in ranks:
        d = delta.get(r)
        if d is None:
            return f"rank {r}: no Engram counters on /metrics"
        if d.get("lookups", 0) <= 0:
            return f"rank {r}: no Engram lookups counted"
        if d.get("fallbacks", 0) != 0:
            return f"rank {r}: {int(d['fallbacks'])} Engram fallbacks"
    return None


def flat_values(text: str, prefix: str) -> dict[str, float]:
    """``{name_without_prefix: value}`` of unlabelled series named ``<prefix>...`` (e.g. the
    engine's ``dsv41_drafter_rounds`` speculator gauges); ``_total`` suffixes dropped."""
    out: dict[str, float] = {}
    for name, labels, value in parse_metrics(text):
        if name.startswith(prefix) and not labels and not name.endswith("_created"):
            key = name[len(prefix):]
            out[key[:-6] if key.endswith("_total") else key] = value
    return out


def fetch_metrics_text(metrics_url: str, timeout_s: float = 10.0) -> str:
    """GET ``metrics_url`` -> Prometheus text; RefsError if unreachable."""
    import httpx

    try:
        with _client(timeout_s) as c:
            r = c.get(metrics_url)
            r.raise_for_status()
    except httpx.HTTPError as exc:
        raise RefsError(f"cannot read metrics at {metrics_url}: {exc}") from exc
    return r.text


def check_drafter(delta: dict) -> str | None:
    """None when rank 0's speculator ran drafting rounds with no identity refusal in ``delta``
    (keys of ``dsv41.drafter.speculators.COUNTER_KEYS``); otherwise one line saying why."""
    if delta.get("identity_refusals", 0) > 0:
        return f"drafter: {int(delta['identity_refusals'])} identity refusals"
    if delta.get("rounds", 0) <= 0:
        fc = int(delta.get("fail_closed_rounds", 0))
        return "drafter: no drafting rounds" + (f" ({fc} failed closed)" if fc else "")
    return None
