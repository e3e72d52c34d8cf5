"""Admission control of the serving endpoint: HOLD (pause) and release (resume).

Endpoint contract (docs/interfaces.md, engine; vLLM's names): ``POST /pause`` stops admitting new
requests (in-flight ones finish), ``POST /resume`` admits again, ``GET /is_paused`` returns
``{"is_paused": bool}``. States here: ``held`` (paused) and ``open``.
"""

from __future__ import annotations

import time

from dsv41.errors import Dsv41Error
from dsv41.harness import http

HELD, OPEN = "held", "open"


class AdmissionError(Dsv41Error):
    """The endpoint cannot be reached or answered something unexpected."""


def status(endpoint: str, timeout_s: float = 10.0) -> str:
    """``held`` or ``open``; AdmissionError when unreachable or the body lacks ``is_paused``."""
    doc = http.request_json("GET", endpoint.rstrip("/") + "/is_paused", timeout_s=timeout_s,
                            what=f"cannot read admission state at {endpoint}", error=AdmissionError)
    paused = doc.get("is_paused") if isinstance(doc, dict) else None
    if not isinstance(paused, bool):
        raise AdmissionError(f"{endpoint}/is_paused returned no boolean is_paused")
    return HELD if paused else OPEN


def set_state(endpoint: str, state: str, timeout_s: float = 30.0, settle_s: float = 10.0) -> str:
    """Move admission to ``state`` (``held``/``open``) and wait until ``/is_paused`` agrees.

    Returns the state before the call. Idempotent: no request is sent when already there.
    Raises AdmissionError on a bad state, HTTP errors, or when the state does not settle within
    ``settle_s`` seconds.
    """
    if state not in (HELD, OPEN):
        raise AdmissionError(f"admission state must be {HELD!r} or {OPEN!r}, not {state!r}")
    before = status(endpoint, timeout_s)
    if before == state:
        return before
    path = "/pause" if state == HELD else "/resume"
    http.request("POST", endpoint.rstrip("/") + path, timeout_s=timeout_s, what=f"POST {path} at {endpoint} failed",
                 error=AdmissionError)
    deadline = time.monotonic() + settle_s
    while status(endpoint, timeout_s) != state:
        if time.monotonic() > deadline:
            raise AdmissionError(f"admission at {endpoint} did not become {state} within {settle_s:g} s")
        time.sleep(0.1)
    return before
