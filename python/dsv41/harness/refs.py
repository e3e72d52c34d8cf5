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
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dsv41.errors import Dsv41Error
from dsv41.harness import http

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
                {"name": r.name, "first_diff": r.first_diff, "expected": r.expected, "got": r.got} for r in self.results
            ],
        }


def first_diff(a: list[int], b: list[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a length difference counts at the shorter
    length); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def served_model(endpoint: str, timeout_s: float = 10.0) -> str:
    """The first model id of ``GET {endpoint}/v1/models``; RefsError if none or unreachable."""
    doc = http.request_json(
        "GET",
        endpoint.rstrip("/") + "/v1/models",
        what=f"cannot list models at {endpoint}",
        timeout_s=timeout_s,
        error=RefsError,
    )
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise RefsError(f"{endpoint}/v1/models lists no model")
    return str(data[0]["id"])


def generate(
    endpoint: str, prompt: str, model: str, max_tokens: int = DEFAULT_MAX_TOKENS, timeout_s: float = 120.0
) -> list[int]:
    """Greedy token ids for one prompt (temperature 0, ``max_tokens`` new tokens at most).

    Raises RefsError when unreachable, on HTTP errors, or when the response lacks
    ``choices[0].token_ids``.
    """
    body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": 0, "return_token_ids": True}
    doc = http.request_json(
        "POST",
        endpoint.rstrip("/") + "/v1/completions",
        json=body,
        timeout_s=timeout_s,
        what=f"completion at {endpoint} failed",
        error=RefsError,
    )
    choices = doc.get("choices") if isinstance(doc, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RefsError(f"{endpoint}/v1/completions returned no choices[0].token_ids (return_token_ids unsupported?)")
    return ids


def run_prompts(
    endpoint: str,
    model: str | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    prompts=PROMPTS,
    timeout_s: float = 120.0,
) -> dict:
    """Run every prompt greedily; returns a refs document (see module docstring)."""
    model = model or served_model(endpoint)
    return {
        "format": FORMAT,
        "model": model,
        "max_tokens": int(max_tokens),
        "recorded_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "prompts": [
            {"name": n, "prompt": p, "token_ids": generate(endpoint, p, model, max_tokens, timeout_s)}
            for n, p in prompts
        ],
    }


def load_refs(path: str | os.PathLike) -> dict:
    """Read and check a refs file; RefsError naming the file on any problem."""
    from dsv41 import fileio

    doc = fileio.read_json(path, "refs", error=RefsError)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RefsError(f"refs {path} is not a {FORMAT} file")
    prompts = doc.get("prompts")
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(
            isinstance(p, dict)
            and isinstance(p.get("name"), str)
            and isinstance(p.get("prompt"), str)
            and isinstance(p.get("token_ids"), list)
            for p in prompts
        )
    ):
        raise RefsError(f"refs {path} has no valid prompts list")
    if not isinstance(doc.get("max_tokens"), int) or doc["max_tokens"] <= 0:
        raise RefsError(f"refs {path} has no valid max_tokens")
    return doc


def save_refs(doc: dict, path: str | os.PathLike) -> None:
    """Write atomically (:func:`dsv41.fileio.atomic_write`: only over a regular file or an absent
    path; parents created); RefsError when it cannot be written (the old file is kept)."""
    from dsv41 import fileio

    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as exc:
        raise RefsError(f"cannot create the directory of refs {path}: {exc.strerror or exc}") from None
    fileio.atomic_write_json(path, doc, "refs", error=RefsError, nonfinite="null")


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


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text exposition -> [(sample name, labels, value)] (``prometheus_client.parser``);
    RefsError when the text is not valid exposition."""
    return http.metric_samples(text, what="metrics", error=RefsError)


def engram_counters(text: str, prefix: str = "dsv41_engram_") -> dict[str, dict[str, float]]:
    """``{rank: {key: value}}`` from metrics named ``<prefix><key>_total{rank="R"}`` (or without
    ``_total``); series without a rank label, ``_created`` and ``_bucket`` samples are ignored.
    RefsError when ``text`` is not Prometheus text."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_metrics(text):
        if not name.startswith(prefix) or "rank" not in labels or name.endswith(("_created", "_bucket")):
            continue
        key = name[len(prefix) :]
        key = key[:-6] if key.endswith("_total") else key
        rank = out.setdefault(labels["rank"], {})
        rank[key] = rank.get(key, 0.0) + value
    return out


def fetch_engram_counters(metrics_url: str, prefix: str = "dsv41_engram_", timeout_s: float = 10.0) -> dict:
    """GET ``metrics_url`` and return :func:`engram_counters`; RefsError if unreachable."""
    return engram_counters(fetch_metrics_text(metrics_url, timeout_s), prefix)


def counter_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per rank and key: after - before (keys absent before count from 0)."""
    return {rank: {k: v - before.get(rank, {}).get(k, 0.0) for k, v in keys.items()} for rank, keys in after.items()}


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
    """``{name_without_prefix: value}`` of unlabelled samples named ``<prefix>...`` (e.g. the
    engine's ``dsv41_drafter_rounds_total`` speculator counters); ``_total`` suffixes dropped,
    ``_created`` samples ignored.  RefsError when ``text`` is not Prometheus text."""
    out: dict[str, float] = {}
    for name, labels, value in parse_metrics(text):
        if name.startswith(prefix) and not labels and not name.endswith("_created"):
            key = name[len(prefix) :]
            out[key[:-6] if key.endswith("_total") else key] = value
    return out


def fetch_metrics_text(metrics_url: str, timeout_s: float = 10.0) -> str:
    """GET ``metrics_url`` -> Prometheus text; RefsError if unreachable."""
    return http.request(
        "GET", metrics_url, what=f"cannot read metrics at {metrics_url}", timeout_s=timeout_s, error=RefsError
    ).text


def read_metrics(metrics: str | Mapping[str, str], timeout_s: float = 10.0) -> str:
    """Prometheus text of ``metrics``: one ``/metrics`` URL (rank 0's on the stand-in engine), or
    ``{rank: url}`` (:func:`dsv41.harness.rank_metrics.urls`), each endpoint read once and the
    texts joined.  RefsError naming the rank and the endpoint when one is unreachable."""
    if isinstance(metrics, str):
        return fetch_metrics_text(metrics, timeout_s)
    from dsv41.harness import rank_metrics

    return rank_metrics.fetch_text(metrics, timeout_s, error=RefsError)


def check_overlay(text: str, ranks: list[str], metrics: str | Mapping[str, str] | None = None) -> str | None:
    """None unless ``text`` carries the vLLM overlay's state and a rank in ``ranks`` is not
    ``active`` (inert or refused: its Engram rows are not remote); then one line naming the rank
    and its endpoint.  The stand-in engine exports no overlay state: always None there."""
    from dsv41.harness import rank_metrics

    try:
        if not rank_metrics.overlay_states(text):
            return None
        return rank_metrics.overlay_problem(text, ranks, metrics if not isinstance(metrics, str) else None)
    except rank_metrics.RankMetricsError as exc:
        raise RefsError(str(exc)) from None


def check_drafter(delta: dict) -> str | None:
    """None when rank 0's speculator ran drafting rounds with no identity refusal in ``delta``
    (keys of ``dsv41.drafter.speculators.COUNTER_KEYS``); otherwise one line saying why."""
    if delta.get("identity_refusals", 0) > 0:
        return f"drafter: {int(delta['identity_refusals'])} identity refusals"
    if delta.get("rounds", 0) <= 0:
        fc = int(delta.get("fail_closed_rounds", 0))
        return "drafter: no drafting rounds" + (f" ({fc} failed closed)" if fc else "")
    return None


# ---- the one reference check (module greedy_refs and `dsv41 refs verify`) ----------------------


@dataclass
class RefsCheck:
    """Outcome of :func:`check`.

    ``action``: ``recorded`` or ``verified`` (what the first attempt did); ``comparison``: the last
    attempt's; ``attempts``: runs of the prompts made; ``counters_delta``: Engram counters per rank
    and ``drafter_delta``: rank 0's speculator counters, after minus before the last attempt
    (None without a metrics URL); ``problem``: None, or one line on the unmet counter
    requirements.  ``ok``: all prompts identical and no problem.
    """

    action: str
    comparison: Comparison
    attempts: int
    counters_delta: dict | None = None
    drafter_delta: dict | None = None
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.comparison.identical == self.comparison.total and self.problem is None

    def message(self, path: str | os.PathLike | None = None) -> str | None:
        """The one failure line (None when ``ok``): token mismatch first (naming the refs
        ``path`` when given), then the counters."""
        if self.comparison.identical != self.comparison.total:
            src = f" from {path}" if path is not None else ""
            return f"greedy references differ{src}: {self.comparison.summary()}"
        if self.problem:
            return f"counters while the references ran ({self.attempts} attempt(s)): {self.problem}"
        return None

    def to_dict(self) -> dict:
        d = {
            "action": self.action,
            "attempts": self.attempts,
            "summary": self.comparison.summary(),
            **self.comparison.to_dict(),
        }
        if self.counters_delta is not None:
            d.update(counters_delta=self.counters_delta, drafter_delta=self.drafter_delta)
        return d


def check(
    endpoint: str,
    path: str | os.PathLike,
    *,
    mode: str = "verify",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout_s: float = 120.0,
    metrics_url: str | Mapping[str, str] | None = None,
    metrics_prefix: str = "dsv41_engram_",
    require_ranks: list[str] | tuple[str, ...] = (),
    require_drafter: bool = False,
    attempts: int = 1,
    delay_s: float = 2.0,
    write: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> RefsCheck:
    """Run the greedy references and the counter requirements: the check of the deploy.

    ``mode``: ``record`` (run the prompts and write ``path`` unless ``write`` is false), ``verify``
    (compare with ``path``) or ``auto`` (verify if ``path`` exists, else record).  With
    ``metrics_url`` (rank 0's ``/metrics``, or ``{rank: url}`` of every rank's counters:
    :func:`read_metrics`) the counters are read before and after each run: every rank in
    ``require_ranks`` must count Engram lookups with zero fallbacks (:func:`check_remote_engram`)
    and, where the vLLM overlay exports its state, run it ``active`` (:func:`check_overlay`) and, with ``require_drafter``, rank 0's speculator must run
    rounds with no identity refusal (:func:`check_drafter`).  Up to ``attempts`` runs,
    ``delay_s`` seconds apart, while only the counters fail (a table server restored a moment ago
    may still be reconnecting); a token mismatch ends at once.  After a recording, later attempts
    verify against it.

    Returns a :class:`RefsCheck` (``ok`` false on a mismatch or unmet requirements).  Raises
    RefsError for a bad argument, an unreachable endpoint, a bad refs file or metrics text.
    """
    if mode not in ("auto", "record", "verify"):
        raise RefsError(f"mode must be auto, record or verify, not {mode!r}")
    if (require_ranks or require_drafter) and not metrics_url:
        raise RefsError("require_ranks needs metrics_url" if require_ranks else "require_drafter needs metrics_url")
    if attempts < 1:
        raise RefsError(f"attempts must be >= 1, got {attempts}")
    if mode == "auto":
        mode = "verify" if os.path.exists(path) else "record"
    action = "recorded" if mode == "record" else "verified"
    attempt = 0
    while True:
        attempt += 1
        before = read_metrics(metrics_url) if metrics_url else None
        if mode == "record":
            doc = run_prompts(endpoint, None, max_tokens, timeout_s=timeout_s)
            cmp = compare(doc, doc)
            if write:
                save_refs(doc, path)
                mode = "verify"  # recorded once; later attempts compare against it
        else:
            cmp = verify(endpoint, load_refs(path), timeout_s=timeout_s)
        engram = drafter = None
        problems: list[str | None] = []
        if before is not None:
            after = read_metrics(metrics_url)
            engram = counter_delta(engram_counters(before, metrics_prefix), engram_counters(after, metrics_prefix))
            drafter = counter_delta(
                {"": flat_values(before, "dsv41_drafter_")}, {"": flat_values(after, "dsv41_drafter_")}
            )[""]
            if require_ranks:
                problems.append(
                    check_overlay(after, list(require_ranks), metrics_url)
                    or check_remote_engram(engram, list(require_ranks))
                )
            if require_drafter:
                problems.append(check_drafter(drafter))
        problem = "; ".join(x for x in problems if x) or None
        if cmp.identical != cmp.total or problem is None or attempt >= attempts:
            return RefsCheck(action, cmp, attempt, engram, drafter, problem)
        sleep(delay_s)
