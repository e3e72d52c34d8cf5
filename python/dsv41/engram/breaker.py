"""The circuit breaker of :class:`dsv41.engram.client.RemoteRowSource`: its connection to the
table server, how a failed request retires it, and the background probe that reconnects
(connect + HELLO, backoff ``RECONNECT_MIN_S`` .. ``RECONNECT_MAX_S`` jittered x0.5..1.5); the
errors a remote lookup raises.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from dsv41.errors import Dsv41Error
from dsv41.transport import Refused, TransportError, TransportTimeout, open_client

RECONNECT_MIN_S, RECONNECT_MAX_S = 0.05, 0.5  # the probe's backoff (seconds, jittered x0.5..1.5)


class RemoteUnavailable(Dsv41Error):
    """Remote rows were required (``required=True`` or no local fallback) but could not be read."""


class DeadlineExceeded(TransportTimeout):
    """A lookup's whole-call deadline (``deadline_ms``) passed: waiting for the connection lock,
    before a request, or during a request whose timeout the deadline had cut short."""


class Breaker:
    """The connection half of :class:`dsv41.engram.client.RemoteRowSource` (a base class: its
    ``__init__`` sets the state used here: ``endpoint``, ``_idents``, ``timeout_s``, ``spin_us``,
    ``rank``, ``_lock`` (the client and its counters ``_c``), ``_rlock``, ``_client``,
    ``_retired``, ``_ever_connected``, ``_closed``, ``_wake``, ``_thread``, ``last_error``).
    While ``_client`` is None the breaker is open and lookups go to the local rows."""

    def _connect(self):
        return open_client(self.endpoint, list(self._idents.values()), max(self.timeout_s, 0.5), spin_us=self.spin_us)

    def _fail_locked(self, client: Any, exc: BaseException, deadline_hit: bool) -> None:
        """Count a failed request and retire its connection (caller holds ``_lock``).

        ``deadline_hit``: the call's deadline ended it (counted in ``deadline_exceeded``). A
        ``DeadlineExceeded`` raised between requests leaves nothing in flight, so the
        connection is kept; any other failure retires it (a late reply must never reach a
        buffer), and the reconnect thread closes it: a NIXL teardown never delays the lookup."""
        c = self._c
        if deadline_hit or isinstance(exc, DeadlineExceeded):
            c["deadline_exceeded"] += 1
        if isinstance(exc, DeadlineExceeded):
            return
        if isinstance(exc, Refused):
            c["refusals"] += 1
        else:
            c["transport_errors"] += 1
        self.last_error = str(exc)
        self._client = None
        c["breaker_opens"] += 1
        if self._closed.is_set():
            client.close()
        else:
            self._retired.append(client)

    def _note_connect_failure(self, exc: BaseException) -> None:
        # counted apart from lookup failures, which they would otherwise inflate while a server is down
        with self._lock:
            self._c["connect_failures"] += 1
        self.last_error = str(exc)

    def _close_retired(self) -> None:
        with self._lock:
            dead, self._retired = self._retired, []
        for client in dead:
            client.close()

    def _start_reconnect(self) -> None:
        with self._rlock:  # one reconnect thread at most, even when lookups fail concurrently
            if self._closed.is_set():
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._reconnect_loop, name=f"engram-reconnect-{self.rank}", daemon=True
                )
                self._thread.start()

    def _reconnect_loop(self) -> None:
        delay = RECONNECT_MIN_S
        while not self._closed.is_set():
            self._close_retired()
            self._wake.wait(delay * (0.5 + random.random()))
            if self._closed.is_set():
                return
            try:
                client = self._connect()
            except TransportError as exc:
                self._note_connect_failure(exc)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    return
                self._client = client
                if self._ever_connected:
                    self._c["reconnects"] += 1
            self._ever_connected = True
            self._close_retired()
            return

    @property
    def connected(self) -> bool:
        """Whether a connection to the server is up (False: the breaker is open, lookups go local)."""
        return self._client is not None

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected or ``timeout_s`` passed (tests, start-up scripts)."""
        end = time.monotonic() + timeout_s
        while self._client is None and time.monotonic() < end:
            time.sleep(0.01)
        return self._client is not None
