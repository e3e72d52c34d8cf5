"""Read a running drafter worker's state from its Prometheus ``/metrics`` (torch-free).

Used by ``dsv41 drafter status`` (and so by ``playbooks/verify.yml``): the number of open client
connections and the identities the worker serves, parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

from dsv41.errors import Dsv41Error
from dsv41.harness import http

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
    for name, labels, value in http.metric_samples(
        text, what="drafter status: unreadable metrics text", error=Dsv41Error
    ):
        if name == CONNECTIONS:
            connections = int(value)
        elif name == INFO:
            identities.update({k: labels.get(k, "") for k in IDENTITY_LABELS})
    if connections is None:
        raise Dsv41Error(f"drafter status: no {CONNECTIONS} in the metrics (is this a drafter worker?)")
    return {"connections": connections, "identities": identities}


def fetch_status(metrics_url: str, timeout_s: float = 10.0) -> dict:
    """GET ``metrics_url`` (the worker's ``/metrics``) and parse it with :func:`parse_status`.

    Raises :class:`Dsv41Error` with one line when the worker cannot be reached or answers non-2xx
    (``harness.http.request``).
    """
    r = http.request(
        "GET", metrics_url, what=f"drafter status: cannot read {metrics_url}", timeout_s=timeout_s, error=Dsv41Error
    )
    return parse_status(r.text)
