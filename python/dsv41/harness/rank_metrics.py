"""Where each TP rank's Engram and drafter counters are read: the one answer every reader uses.

The stand-in engine (``serve_runtime: lab``) gathers every rank's counters onto rank 0's API
``/metrics`` (``dsv41_engram_*{rank}``, :mod:`dsv41.engine.metrics`).  Under vLLM
(``serve_runtime: vllm``) the overlay exports them per rank on each Spark's management address
(:mod:`dsv41.overlay.metrics`, port ``dsv41_overlay_metrics_port``), with the same names plus
``dsv41_overlay_state{rank, state}`` and ``dsv41_overlay_transport_info{rank, implementation}``.

The runtime facts (:func:`urls`' ``facts``) come from the inventory (roles/dsv41 defaults,
``dsv41_rank_metrics``), or from a CLI's ``--metrics-runtime/--rank-address`` options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv41.errors import Dsv41Error
from dsv41.harness import http

RUNTIMES = ("lab", "vllm")
#: Runtimes whose counters come from the overlay's per-rank endpoints.
OVERLAY_RUNTIMES = ("vllm",)
#: The key of rank 0's API ``/metrics`` in a URL map (:func:`with_api`).
API = "api"


class RankMetricsError(Dsv41Error):
    """Bad runtime facts, an unreachable rank endpoint, or an overlay that is not active."""


def urls(facts: Mapping[str, Any]) -> dict[str, str]:
    """``{rank: metrics URL}`` (ranks as strings, in rank order) from the runtime facts.

    ``facts``: ``runtime`` (``lab`` or ``vllm``), ``api_url`` (rank 0's API base URL,
    ``http://H:P``), ``ranks`` (``{rank: management address}`` of every Spark),
    ``overlay_port`` (1..65535, used under vLLM) and, optionally, ``overlay_ranks`` (the ranks
    whose overlay the inventory turns on: remote Engram or remote drafting; default every rank).
    ``lab``: every rank reads rank 0's API ``/metrics``; ``vllm``: rank R of ``overlay_ranks``
    reads ``http://<address of R>:<overlay_port>/metrics`` (a rank without the overlay runs vLLM's
    own code and exports no dsv41 counters: it has no entry).
    RankMetricsError naming the fact on bad input (unknown runtime, no ranks, a rank that is not
    a number, an address with a path, scheme or port, a bad port).
    """
    if not isinstance(facts, Mapping):
        raise RankMetricsError(f"rank metrics facts must be a mapping, got {type(facts).__name__}")
    runtime = str(facts.get("runtime", ""))
    if runtime not in RUNTIMES:
        raise RankMetricsError(f"rank metrics: runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    ranks = facts.get("ranks")
    if not isinstance(ranks, Mapping) or not ranks:
        raise RankMetricsError("rank metrics: ranks must map each TP rank to its management address")
    order: list[tuple[int, str]] = []
    for r, addr in ranks.items():
        text = str(r).strip()
        if not text.isdigit():
            raise RankMetricsError(f"rank metrics: rank {r!r} is not a TP rank number")
        order.append((int(text), str(addr).strip()))
    order.sort()
    if runtime not in OVERLAY_RUNTIMES:
        api = str(facts.get("api_url") or "").rstrip("/")
        if not api.startswith(("http://", "https://")):
            raise RankMetricsError(f"rank metrics: api_url must be http://HOST:PORT, got {facts.get('api_url')!r}")
        return {str(r): api + "/metrics" for r, _ in order}
    port = facts.get("overlay_port")
    try:
        port_n = int(str(port))
    except ValueError:
        port_n = 0
    if not 1 <= port_n <= 65535:
        raise RankMetricsError(f"rank metrics: overlay_port must be 1..65535, got {port!r}")
    wanted = facts.get("overlay_ranks")
    if wanted is not None and not isinstance(wanted, (list, tuple)):
        raise RankMetricsError(f"rank metrics: overlay_ranks must be a list of TP ranks, got {wanted!r}")
    keep = None if wanted is None else {str(x).strip() for x in wanted}
    out = {}
    for r, addr in order:
        if keep is not None and str(r) not in keep:
            continue
        if not addr or any(c in addr for c in "/@?#[] ") or addr.count(":") > 0:
            raise RankMetricsError(
                f"rank metrics: rank {r}'s address must be a bare host name or IPv4 address, got {addr!r}"
            )
        out[str(r)] = f"http://{addr}:{port_n}/metrics"
    return out


def with_api(rank_urls: Mapping[str, str], api_url: str) -> dict[str, str]:
    """``rank_urls`` plus rank 0's API ``/metrics`` under the key :data:`API` (vLLM's own
    ``vllm:*`` series, which stay there under both runtimes); read once when it is already a
    rank's URL (the stand-in engine)."""
    out = dict(rank_urls)
    out[API] = api_url.rstrip("/") + "/metrics"
    return out


def overlay_runtime(facts: Mapping[str, Any]) -> bool:
    """True when ``facts`` name a runtime whose counters come from the overlay's endpoints."""
    return str(facts.get("runtime", "")) in OVERLAY_RUNTIMES


def fetch_text(
    rank_urls: Mapping[str, str], timeout_s: float = 10.0, error: type[Dsv41Error] = RankMetricsError
) -> str:
    """GET every distinct URL of ``rank_urls`` (``{rank: url}``, :func:`urls`) once and return
    the Prometheus texts joined (rank 0's first); the result parses like the stand-in engine's
    rank 0 ``/metrics``.  ``error`` naming the rank(s) and the endpoint when one is unreachable or
    answers other than 200."""
    seen: dict[str, list[str]] = {}
    for r, u in rank_urls.items():
        seen.setdefault(u, []).append(str(r))
    parts = []
    for u, ranks in seen.items():
        named = [r for r in ranks if r != API]
        who = (
            "rank 0's API"
            if not named
            else "rank " + ", ".join(named)
            if len(named) == 1
            else "ranks " + ", ".join(named)
        )
        parts.append(
            http.request(
                "GET", u, what=f"{who}: metrics endpoint {u} unreachable", timeout_s=timeout_s, error=error
            ).text
        )
    return "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)


def overlay_states(text: str) -> dict[str, dict[str, str]]:
    """``{rank: {"state": ..., "transport": ...}}`` from ``dsv41_overlay_state`` (the label whose
    value is 1) and ``dsv41_overlay_transport_info``; empty for the stand-in engine's text."""
    out: dict[str, dict[str, str]] = {}
    for name, labels, value in http.metric_samples(text, what="overlay metrics", error=RankMetricsError):
        if "rank" not in labels:
            continue
        if name == "dsv41_overlay_state" and value == 1:
            out.setdefault(labels["rank"], {})["state"] = labels.get("state", "")
        elif name == "dsv41_overlay_transport_info" and value == 1:
            out.setdefault(labels["rank"], {})["transport"] = labels.get("implementation", "")
    return out


def overlay_problem(
    text: str, ranks: list[str] | tuple[str, ...], rank_urls: Mapping[str, str] | None = None
) -> str | None:
    """None when every rank in ``ranks`` reports ``dsv41_overlay_state{state="active"}``; else
    one line naming the first rank that does not (inert, refused, or no state on its endpoint)."""
    states = overlay_states(text)
    for r in ranks:
        where = f" ({rank_urls[r]})" if rank_urls and r in rank_urls else ""
        st = states.get(str(r), {}).get("state")
        if st is None:
            return f"rank {r}: no overlay state on its metrics endpoint{where}"
        if st != "active":
            return (
                f"rank {r}: the overlay is {st}{where}, so its Engram rows and drafts are not remote "
                "(see the serve log's 'dsv41 overlay' lines)"
            )
    return None


def facts_from_options(runtime: str, api_url: str, rank_addresses: list[str], overlay_port: int) -> dict[str, Any]:
    """Runtime facts from CLI options: ``rank_addresses`` as ``RANK=ADDRESS`` items (RankMetricsError
    on another shape); with none, rank 0 and 1 at the API's host."""
    ranks: dict[str, str] = {}
    for item in rank_addresses:
        r, sep, addr = item.partition("=")
        if not sep:
            raise RankMetricsError(f"--rank-address must be RANK=ADDRESS, got {item!r}")
        ranks[r.strip()] = addr.strip()
    if not ranks:
        from urllib.parse import urlsplit

        host = urlsplit(api_url).hostname or ""
        ranks = {"0": host, "1": host}
    return {"runtime": runtime, "api_url": api_url, "ranks": ranks, "overlay_port": overlay_port}
