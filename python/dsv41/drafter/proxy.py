"""The async drafting proxy: a separate, torch-free CPU process that owns the drafter connection.

The engine writes encoded ROUND payloads into a shared-memory ring slot (state REQUEST); the proxy
takes the slot (TAKEN), runs the round against the worker (identity-checked hello, per-round
timeout, late replies dropped by generation) and publishes the DRAFTS payload or an error status
(REPLY). It writes its heartbeat and state into the ring's host flags every loop, naps
``nap_us`` between polls when idle, and exits when the engine sets the stop flag, when its parent
process is gone, or - when no parent pid is given to watch - when the engine heartbeat is older
than ``engine_timeout_s`` (an orphaned proxy never lingers; an idle engine does not beat). This module must not import torch (checked by a test).
"""

from __future__ import annotations

import logging
import os
import time

from dsv41.drafter import protocol as P
from dsv41.drafter.client import DrafterClient, DrafterUnavailable, IdentityMismatch, RoundTimeout, WorkerRefused
from dsv41.drafter.memlock import MemlockState, lock_all, unlock_all
from dsv41.drafter.shm import ProxyState, Ring, SlotState

log = logging.getLogger("dsv41.drafter.proxy")


def _busy(ring: Ring, seconds: float) -> None:
    """Publish a heartbeat ``seconds`` in the future before a call that may block that long.

    The engine's watchdog reads the heartbeat age; a proxy blocked in a round (up to its
    timeout) or a connect is healthy, and must not be killed just because its watchdog period is
    shorter than that wait. Once the promised time has passed without a fresh beat, the
    watchdog fires as usual.
    """
    ring.proxy_heartbeat = time.monotonic_ns() + int(seconds * 1e9)


def _try_connect(client: DrafterClient, ring: Ring, *, force: bool = False) -> None:
    _busy(ring, 2 * client.connect_timeout_s)  # TCP connect + hello, each bounded by it
    try:
        client.connect(force=force)
        ring.proxy_state = ProxyState.CONNECTED
        ring.error = ""
    except IdentityMismatch as exc:
        ring.proxy_state = ProxyState.REFUSED
        ring.error = str(exc)
    except DrafterUnavailable as exc:
        if "waiting to reconnect" not in str(exc):
            ring.proxy_state = ProxyState.DISCONNECTED
            ring.error = str(exc)


def run_proxy(
    shm_name: str,
    url: str,
    expected: dict,
    *,
    timeout_ms: float = 100.0,
    nap_us: float = 50.0,
    engine_timeout_s: float = 10.0,
    reconnect_s: float = 1.0,
    parent_pid: int | None = None,
    max_rounds: int | None = None,
    nap_max_us: float = 1000.0,
    memlock: bool = False,
) -> int:
    """Serve rounds from the ring named ``shm_name`` until told to stop; returns rounds served.

    Idle naps start at ``nap_us`` and double up to ``nap_max_us`` while no round arrives (reset
    by each round): the reply is needed only at the engine's next step, so a short pickup delay
    costs nothing while a hot spin would steal a core from the engine on a small host.

    ``memlock``: (the CLI's default; off here, so an in-process caller is not locked by accident)
    lock the process's memory first (:func:`dsv41.drafter.memlock.lock_all`) and
    publish the result in the ring (``proxy_memlock``); a refusal is logged with its limit and
    the proxy serves unlocked (slower rounds, never wrong ones).

    Raises :class:`dsv41.errors.Dsv41Error` when the ring cannot be attached or the URL is bad.
    """
    ring = Ring.attach(shm_name)
    if memlock:
        rep = lock_all()  # after the attach: the ring's mapping is locked with the rest
        ring.proxy_memlock = rep.state
        if rep.state != MemlockState.LOCKED:
            log.error("drafter proxy: memory not locked: %s", rep.detail)
        else:
            log.info("drafter proxy: memory locked (%d KiB)", rep.locked_kib)
    else:
        ring.proxy_memlock = MemlockState.OFF
    client = DrafterClient(url, expected, timeout_ms=timeout_ms, reconnect_s=reconnect_s, client_name="proxy")
    ring.proxy_pid = os.getpid()
    ring.proxy_state = ProxyState.STARTING
    ring.beat_proxy()
    _try_connect(client, ring, force=True)
    served = 0
    orphaned = False
    nap_min, nap_max = nap_us / 1e6, max(nap_us, nap_max_us) / 1e6
    nap = nap_min
    seen = {k: 0 for k in ("timeouts", "refusals", "identity_refusals", "reconnects", "late_dropped")}
    try:
        while True:
            ring.beat_proxy()
            if ring.stop:
                break
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("drafter proxy: parent %d is gone, exiting", parent_pid)
                orphaned = True
                break
            # The engine beats only when it drafts, so an idle engine goes quiet: with a parent
            # to watch, its death is the signal (else every idle spell of engine_timeout_s
            # would kill the proxy and spend the engine's respawn budget); without one, the
            # heartbeat is all there is.
            eng = ring.engine_heartbeat
            if parent_pid is None and eng and (time.monotonic_ns() - eng) / 1e9 > engine_timeout_s:
                log.warning("drafter proxy: engine heartbeat older than %.1f s, exiting", engine_timeout_s)
                orphaned = True
                break
            reqs = ring.find(SlotState.REQUEST)
            if not reqs:
                if ring.proxy_state != ProxyState.CONNECTED:
                    _try_connect(client, ring)
                time.sleep(nap)
                nap = min(nap * 2, nap_max)
                continue
            nap = nap_min
            for i in reqs:
                got = ring.read(i)
                if got is None:
                    continue  # torn write: not published completely yet
                seq, _, payload = got
                ring.set_state(i, SlotState.TAKEN)
                ring.bump("rounds")
                status, body = P.Status.OK, b""
                # a (re)connect inside round_raw plus the round itself
                _busy(ring, 2 * client.connect_timeout_s + client.timeout_s)
                try:
                    body = client.round_raw(payload)
                    ring.proxy_state = ProxyState.CONNECTED
                    ring.bump("rounds_ok")
                except RoundTimeout as exc:
                    status, body = P.Status.TIMEOUT, str(exc).encode()
                except WorkerRefused as exc:
                    status, body = exc.status, str(exc).encode()
                except IdentityMismatch as exc:
                    ring.proxy_state = ProxyState.REFUSED
                    ring.error = str(exc)
                    status, body = P.Status.IDENTITY_MISMATCH, str(exc).encode()
                except DrafterUnavailable as exc:
                    if ring.proxy_state != ProxyState.REFUSED:
                        ring.proxy_state = ProxyState.DISCONNECTED
                    ring.bump("unavailable")
                    status, body = P.Status.UNAVAILABLE, str(exc).encode()
                for k in seen:
                    cur = client.counters[k]
                    if cur != seen[k]:
                        ring.bump(k, cur - seen[k])
                        seen[k] = cur
                if len(body) > ring.slot_size:
                    status, body = P.Status.LIMIT, b"reply larger than the ring slot"
                ring.write(i, SlotState.REPLY, seq, body, int(status))
                served += 1
                ring.beat_proxy()
            if max_rounds is not None and served >= max_rounds:
                break
    finally:
        ring.proxy_state = ProxyState.STOPPED
        client.close()
        name = ring.shm._name  # noqa: SLF001 - the OS-level name ("/psm_...")
        ring.close()
        if orphaned:  # the engine died without unlinking its ring (e.g. SIGKILL): do it for it
            try:
                from multiprocessing.shared_memory import _posixshmem  # no tracker bookkeeping here

                _posixshmem.shm_unlink(name)
            except (ImportError, OSError):
                pass
    return served


def self_test(memlock: bool = False) -> dict:
    """Torch-free self-test: ring create/attach round trip, host flags and (``memlock``) the
    memory locking the proxy will do, probed in this process and undone (the CLI's default: a
    short-lived process; off here, since locking a large caller faults in all it maps); returns a report.

    Report keys: ``ring``, ``host_flags`` ("ok"), ``torch_loaded`` (False), ``pid``, and with
    ``memlock`` ``mlock`` ("ok" or the refusal's one line, e.g. ``ENOMEM`` with the
    ``RLIMIT_MEMLOCK`` limits) and ``mlock_report`` (:meth:`MemlockReport.as_dict`). A refused
    lock is reported, not raised: the caller's check decides (the bring-up's async gate fails on it).

    Raises :class:`dsv41.errors.Dsv41Error` when the ring or host flags fail or torch was imported.
    """
    import sys

    from dsv41.errors import Dsv41Error

    ring = Ring.create(2, 4096)
    try:
        other = Ring.attach(ring.name, untrack=False)
        try:
            ring.write(0, SlotState.REQUEST, 7, b"ping")
            seq, status, data = other.read(0)
            if (seq, status, data) != (7, 0, b"ping") or other.slot_state(0) != SlotState.REQUEST:
                raise Dsv41Error("proxy self-test: ring round trip failed")
            other.beat_proxy()
            if ring.proxy_heartbeat == 0:
                raise Dsv41Error("proxy self-test: host flag not shared")
        finally:
            other.close()
    finally:
        ring.close()
    torch_loaded = "torch" in sys.modules
    if torch_loaded:
        raise Dsv41Error("proxy self-test: torch was imported into the proxy process")
    rep = {"ring": "ok", "host_flags": "ok", "torch_loaded": False, "pid": os.getpid()}
    if memlock:
        ml = lock_all()
        if ml.state == MemlockState.LOCKED:
            unlock_all()
        rep["mlock"] = "ok" if ml.state == MemlockState.LOCKED else ml.detail
        rep["mlock_report"] = ml.as_dict()
    return rep
