"""Read a running drafter worker's state from its Prometheus ``/metrics`` (torch-free).

Used by ``dsv41 drafter status`` (and so by ``playbooks/verify.yml``): the number of open client
connections and the identities the worker serves, parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dsv41.errors import Dsv41Error

CONNECTIONS = "dsv41_drafter_connections"
INFO = "dsv41_drafter_info"
IDENTITY_LABELS = ("drafter", "markov", "target")


def parse_status(text: str) -> dict:
    """State of a worker from its ``/metrics`` text (Prometheus exposition format 0.0.4).

    Returns ``{"connections": int, "identities": {"drafter", "markov", "target": hex str}}``;
    an identity the worker does not export is "". Raises :class:`Dsv41Error` on text the parser
    refuses or when the worker's connection gauge is missing (not a drafter worker).
    """
    connections = None
    identities = {k: "" for k in IDENTITY_LABELS}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == CONNECTIONS:
                    connections = int(s.value)
                elif s.name == INFO:
                    identities.update({k: s.labels.get(k, "") for k in IDENTITY_LABELS})
    except ValueError as exc:
        raise Dsv41Error(f"drafter status: unreadable metrics text: {exc}") from None
    if connections is None:
        raise Dsv41Error(f"drafter status: no {CONNECTIONS} in the metrics (is this a drafter worker?)")
    return {"connections": connections, "identities": identities}


def fetch_status(metrics_url: str, timeout_s: float = 10.0) -> dict:
    """GET ``metrics_url`` (the worker's ``/metrics``) and parse it with :func:`parse_status`.

    Raises :class:`Dsv41Error` with one line when the worker cannot be reached or answers non-200.
    """
    try:
        r = httpx.get(metrics_url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise Dsv41Error(f"drafter status: cannot read {metrics_url}: {exc}") from None
    if r.status_code != 200:
        raise Dsv41Error(f"drafter status: {metrics_url} answered HTTP {r.status_code}")
    return parse_status(r.text)
