"""Admission control of the serving endpoint: HOLD (pause) and release (resume).

Endpoint contract (docs/interfaces.md, engine; vLLM 0.33.0's dev-mode routes, present only with
``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait&timeout_s=S`` stops admitting new requests and
lets in-flight ones finish (bounded by ``S``; the lab engine then aborts and counts the rest),
``POST /resume`` admits again, ``GET /is_paused`` returns ``{"is_paused": bool}``. The mode is sent
explicitly: vLLM's default (``abort``) would kill in-flight requests. States here: ``held``
(paused) and ``open``.

A drain covers only the requests in flight at its pause (docs/engine.md, "Pause, resume and
drains"): a ``/resume`` (or another HOLD) sent while a HOLD's drain runs ends that drain without
aborting anything, so releasing a HOLD early never kills the traffic admitted after it; the
held :func:`set_state` then fails its settle check (the state is ``open``), which is the truth.
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
    doc = http.request_json(
        "GET",
        endpoint.rstrip("/") + "/is_paused",
        timeout_s=timeout_s,
        what=f"cannot read admission state at {endpoint}",
        error=AdmissionError,
    )
    paused = doc.get("is_paused") if isinstance(doc, dict) else None
    if not isinstance(paused, bool):
        raise AdmissionError(f"{endpoint}/is_paused returned no boolean is_paused")
    return HELD if paused else OPEN


def set_state(
    endpoint: str, state: str, timeout_s: float = 30.0, settle_s: float = 10.0, drain_s: float = 600.0
) -> str:
    """Move admission to ``state`` (``held``/``open``) and wait until ``/is_paused`` agrees.

    ``held`` drains: ``POST /pause?mode=wait&timeout_s=drain_s`` (the HTTP call may take up to
    ``drain_s + timeout_s`` seconds). Returns the state before the call. Idempotent: no request
    is sent when already there, except a HOLD while ``DSV41_WINDOW_TOKEN`` is set: that one is
    always sent, with ``&window=TOKEN``, so the held engine admits the window's own requests.
    The request carries the operator credential (``DSV41_OPERATOR_CREDENTIAL_FILE``,
    ``dsv41.authz``); error messages never show the window token. Raises AdmissionError on a bad
    state, HTTP errors (401/403: no or a wrong credential), or when the state does not settle
    within ``settle_s`` seconds.
    """
    if state not in (HELD, OPEN):
        raise AdmissionError(f"admission state must be {HELD!r} or {OPEN!r}, not {state!r}")
    before = status(endpoint, timeout_s)
    token = http.window_headers().get(http.WINDOW_HEADER)
    # a window's HOLD is (re)sent even when held: it names the window the engine still admits
    if before == state and not (state == HELD and token):
        return before
    path = f"/pause?mode=wait&timeout_s={drain_s:g}" if state == HELD else "/resume"
    if state == HELD and token:
        path += f"&window={token}"
    http.request(
        "POST",
        endpoint.rstrip("/") + path,
        timeout_s=timeout_s + (drain_s if state == HELD else 0.0),
        what=f"POST {path.split('&window=')[0]} at {endpoint} failed",
        error=AdmissionError,
        operator=True,
    )
    deadline = time.monotonic() + settle_s
    while status(endpoint, timeout_s) != state:
        if time.monotonic() > deadline:
            raise AdmissionError(f"admission at {endpoint} did not become {state} within {settle_s:g} s")
        time.sleep(0.1)
    return before
