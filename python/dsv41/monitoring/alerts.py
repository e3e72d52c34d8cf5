"""The alerts a Prometheus has firing, for ``dsv41 status --prometheus URL`` (Prometheus HTTP API
``GET /api/v1/alerts``, https://prometheus.io/docs/prometheus/latest/querying/api/#alerts)."""

from __future__ import annotations

from dsv41.errors import Dsv41Error


class AlertsError(Dsv41Error):
    """The Prometheus did not answer, or its answer is not the alerts API's shape."""


def firing(prometheus_url: str, timeout_s: float = 5.0, prefix: str = "Dsv41") -> list[dict]:
    """Firing alerts whose name starts with ``prefix`` ("" = all), as
    ``[{"name", "severity", "labels": {..}, "summary", "active_at"}]`` sorted by name then labels.
    Pending alerts (inside their ``for:``) are left out. Raises AlertsError (one line)."""
    from dsv41.harness import http

    url = prometheus_url.rstrip("/") + "/api/v1/alerts"
    try:
        doc = http.request_json("GET", url, what=f"Prometheus {prometheus_url}", timeout_s=timeout_s, error=AlertsError)
    except AlertsError:
        raise
    try:
        if doc.get("status") != "success":
            raise AlertsError(f"Prometheus {prometheus_url}: /api/v1/alerts status {doc.get('status')!r}")
        raw = doc["data"]["alerts"]
        out = []
        for a in raw:
            labels = dict(a.get("labels") or {})
            name = str(labels.pop("alertname", "?"))
            if a.get("state") != "firing" or not name.startswith(prefix):
                continue
            out.append(
                {
                    "name": name,
                    "severity": str(labels.pop("severity", "")),
                    "labels": labels,
                    "summary": str((a.get("annotations") or {}).get("summary", "")),
                    "active_at": str(a.get("activeAt", "")),
                }
            )
    except (AttributeError, KeyError, TypeError) as exc:
        raise AlertsError(f"Prometheus {prometheus_url}: /api/v1/alerts is not the alerts API ({exc!r})") from None
    return sorted(out, key=lambda x: (x["name"], sorted(x["labels"].items())))


def describe(alert: dict) -> str:
    """One line: ``Name{k=v,...} (severity): summary``."""
    keep = {k: v for k, v in alert["labels"].items() if k in ("rank", "instance", "host", "job")}
    lab = "{" + ",".join(f"{k}={v}" for k, v in sorted(keep.items())) + "}" if keep else ""
    sev = f" ({alert['severity']})" if alert.get("severity") else ""
    return f"{alert['name']}{lab}{sev}: {alert.get('summary') or 'firing'}"
