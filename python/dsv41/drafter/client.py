"""Torch-free drafter client: one TCP connection to a worker, hello + identity check, rounds
with per-round timeouts and generation-based dropping of late replies.

Used by the synchronous remote speculator (in the engine process) and by the async proxy (a
separate process). Failures never raise out of :meth:`DrafterClient.round_raw` other than as the
typed errors below, so callers can fail closed (no drafts) and count why.
"""

from __future__ import annotations

import logging
import socket
import time

from dsv41.drafter import protocol as P
from dsv41.errors import Dsv41Error

log = logging.getLogger("dsv41.drafter.client")


class DrafterUnavailable(Dsv41Error):
    """The worker cannot be reached (connect failed, connection lost, backoff in force)."""


class IdentityMismatch(Dsv41Error):
    """The worker's drafter / Markov / target identity differs from the expected one."""


class RoundTimeout(Dsv41Error):
    """No reply for this round within its timeout (a late reply is dropped by generation)."""


class WorkerRefused(Dsv41Error):
    """The worker answered the round with an ERROR frame (``status``)."""

    def __init__(self, status: P.Status, message: str) -> None:
        super().__init__(f"drafter worker refused the round: {status.name}: {message}")
        self.status = status


COUNTER_KEYS = (
    "rounds",
    "rounds_ok",
    "timeouts",
    "late_dropped",
    "refusals",
    "identity_refusals",
    "reconnects",
    "connect_failures",
    "disconnects",
    "latency_sum_s",
    "latency_count",
)


class DrafterClient:
    """A client for ``dsv41 drafter serve``.

    ``expected``: dict with hex sha256 ``drafter``, ``markov``, ``target`` identities; every
    non-empty one must equal the worker's (else :class:`IdentityMismatch`, counted, and the
    client refuses to use that worker until ``reconnect_s`` has passed). ``timeout_ms``: default
    per-round timeout. ``reconnect_s``: minimum time between connection attempts.
    """

    def __init__(
        self,
        url: str,
        expected: dict,
        *,
        timeout_ms: float = 100.0,
        connect_timeout_ms: float = 500.0,
        reconnect_s: float = 1.0,
        client_name: str = "spark",
    ) -> None:
        self.host, self.port = P.parse_url(url)
        self.url = url
        self.expected = {k: (expected.get(k) or "") for k in ("drafter", "markov", "target")}
        self.timeout_s = timeout_ms / 1000.0
        self.connect_timeout_s = connect_timeout_ms / 1000.0
        self.reconnect_s = reconnect_s
        self.client_name = client_name
        self.sock: socket.socket | None = None
        self.hello: P.Hello | None = None
        self.gen = 0
        self._buf = bytearray()
        self._last_attempt = -1e18
        self._ever_connected = False
        self._refused = False
        self.last_error = ""
        self.counters = {k: 0 for k in COUNTER_KEYS}
        self.counters["latency_sum_s"] = 0.0

    # ------------------------------------------------------------------ connection

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self._buf.clear()

    def _fail(self, exc: Exception) -> None:
        if self.sock is not None:
            self.counters["disconnects"] += 1
        self.close()
        self.last_error = str(exc)

    def connect(self, *, force: bool = False) -> P.Hello:
        """Connect and exchange hellos unless connected.

        Raises :class:`DrafterUnavailable` (also while the reconnect backoff is in force, unless
        ``force``) or :class:`IdentityMismatch`.
        """
        if self.sock is not None and self.hello is not None:
            return self.hello
        now = time.monotonic()
        if not force and now - self._last_attempt < self.reconnect_s:
            if self._refused:  # stay refused (fail closed) until the next attempt
                raise IdentityMismatch(self.last_error)
            raise DrafterUnavailable(f"drafter {self.url}: waiting to reconnect ({self.last_error})")
        self._last_attempt = now
        self._refused = False
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as exc:
            self.counters["connect_failures"] += 1
            self.last_error = f"connect failed: {exc}"
            raise DrafterUnavailable(f"drafter {self.url}: {self.last_error}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        try:
            sock.settimeout(self.connect_timeout_s)
            P.send_frame(sock, P.Msg.HELLO_REQ, P.HelloRequest(self.expected["target"], self.client_name).encode())
            # a worker that trickles or announces a huge hello cannot hold or bloat the client
            head, payload = P.read_frame(
                sock, deadline=time.monotonic() + self.connect_timeout_s, max_length=P.MAX_HELLO_PAYLOAD
            )
            if head.msg == P.Msg.ERROR:
                msg = payload.decode("utf-8", "replace")
                if head.status == P.Status.IDENTITY_MISMATCH:
                    raise IdentityMismatch(f"drafter {self.url} refused our target identity: {msg}")
                raise DrafterUnavailable(f"drafter {self.url} refused hello: {head.status.name}: {msg}")
            if head.msg != P.Msg.HELLO:
                raise P.ProtocolError(P.Status.BAD_TYPE, f"expected HELLO, got {head.msg.name}")
            hello = P.Hello.decode(payload)
        except IdentityMismatch as exc:
            self.counters["identity_refusals"] += 1
            self._fail(exc)
            self._refused = True
            raise
        except (OSError, ConnectionError, P.ProtocolError, DrafterUnavailable) as exc:
            self.counters["connect_failures"] += 1
            self._fail(exc)
            raise DrafterUnavailable(f"drafter {self.url}: hello failed: {exc}") from None
        got = {"drafter": hello.drafter_identity, "markov": hello.markov_identity, "target": hello.target_identity}
        bad = [k for k, v in self.expected.items() if v and got[k] != v]
        if bad:
            self.counters["identity_refusals"] += 1
            exc = IdentityMismatch(
                f"drafter {self.url}: identity mismatch ({', '.join(f'{k}: worker {got[k][:12]} != expected {self.expected[k][:12]}' for k in bad)}); "
                "refusing this worker, drafting disabled (target-only)"
            )
            self._fail(exc)
            self.hello = None
            self._refused = True
            raise exc
        if self._ever_connected:
            self.counters["reconnects"] += 1
        self._ever_connected = True
        self.hello = hello
        self.last_error = ""
        return hello

    # ------------------------------------------------------------------ rounds

    def _read_frame_until(self, deadline: float) -> tuple[P.Header, bytes]:
        """Read one frame into the persistent buffer, so a timeout never desynchronises."""
        assert self.sock is not None
        while True:
            if len(self._buf) >= P.HEADER_SIZE:
                head = P.unpack_header(bytes(self._buf[: P.HEADER_SIZE]))
                total = P.HEADER_SIZE + head.length
                if len(self._buf) >= total:
                    payload = bytes(self._buf[P.HEADER_SIZE : total])
                    del self._buf[:total]
                    P.check_payload(head, payload)
                    return head, payload
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("round timed out")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("worker closed the connection")
            self._buf += chunk

    def round_raw(self, payload: bytes, timeout_s: float | None = None) -> bytes:
        """Send one encoded ROUND payload and return the DRAFTS payload.

        Raises :class:`DrafterUnavailable`, :class:`IdentityMismatch`, :class:`RoundTimeout` or
        :class:`WorkerRefused`; replies to earlier (timed-out) rounds are dropped and counted.
        """
        self.connect()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.gen += 1
        gen = self.gen
        self.counters["rounds"] += 1
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            assert self.sock is not None
            self.sock.settimeout(max(timeout_s, 0.001))
            self.sock.sendall(P.pack_frame(P.Msg.ROUND, payload, round_id=gen))
            while True:
                head, body = self._read_frame_until(deadline)
                if head.round_id != gen:
                    self.counters["late_dropped"] += 1
                    continue
                if head.msg == P.Msg.ERROR:
                    self.counters["refusals"] += 1
                    raise WorkerRefused(head.status, body.decode("utf-8", "replace"))
                if head.msg != P.Msg.DRAFTS:
                    raise P.ProtocolError(P.Status.BAD_TYPE, f"expected DRAFTS, got {head.msg.name}")
                dt = time.monotonic() - t0
                self.counters["rounds_ok"] += 1
                self.counters["latency_sum_s"] += dt
                self.counters["latency_count"] += 1
                return body
        except TimeoutError:
            self.counters["timeouts"] += 1
            raise RoundTimeout(f"drafter {self.url}: round {gen} timed out after {timeout_s * 1000:.0f} ms") from None
        except (OSError, ConnectionError, P.ProtocolError) as exc:
            self._fail(exc)
            raise DrafterUnavailable(f"drafter {self.url}: connection lost: {exc}") from None

    def round(self, rnd: P.Round, timeout_s: float | None = None) -> P.Drafts:
        """Encode ``rnd``, run it and decode the drafts (item count checked)."""
        body = self.round_raw(rnd.encode(), timeout_s)
        try:
            drafts = P.Drafts.decode(body)
        except P.ProtocolError as exc:
            self._fail(exc)
            raise DrafterUnavailable(f"drafter {self.url}: malformed DRAFTS: {exc}") from None
        if len(drafts.tokens) != len(rnd.items):
            self._fail(RuntimeError("item count mismatch"))
            raise DrafterUnavailable(f"drafter {self.url}: {len(drafts.tokens)} drafts for {len(rnd.items)} items")
        return drafts
