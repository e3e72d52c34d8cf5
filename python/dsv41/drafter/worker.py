"""The remote drafter worker: ``dsv41 drafter serve``.

A threaded TCP server speaking :mod:`dsv41.drafter.protocol`: every connection starts with
HELLO_REQ -> HELLO (identities, limits), then ROUND -> DRAFTS (or ERROR with a status). Rounds from
all connections share one backend under a lock (one GPU stream). Malformed frames are refused with
an ERROR status (the connection is closed when the header itself is bad); a round whose deadline
passed while it queued is answered TIMEOUT without computing. Prometheus metrics (own registry):
``dsv41_drafter_rounds_total``, ``dsv41_drafter_drafts_total``, ``dsv41_drafter_round_seconds``,
``dsv41_drafter_refusals_total{status}``, ``dsv41_drafter_connections``.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import time

from dsv41.drafter import protocol as P
from dsv41.errors import Dsv41Error

log = logging.getLogger("dsv41.drafter.worker")


class BackendFailed(Dsv41Error):
    """The backend can no longer draft (the two-card worker lost its other rank): the round is
    refused INTERNAL and the worker ends (:meth:`DrafterWorker.fail`), so clients fail closed and
    the service manager restarts it."""


class WorkerMetrics:
    """Prometheus metrics of one worker (a private registry, so tests can run several)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.rounds = Counter("dsv41_drafter_rounds", "Drafting rounds answered with drafts", registry=self.registry)
        self.drafts = Counter("dsv41_drafter_drafts", "Draft tokens proposed", registry=self.registry)
        self.items = Counter("dsv41_drafter_items", "Requests drafted for (batch items)", registry=self.registry)
        self.latency = Histogram(
            "dsv41_drafter_round_seconds",
            "Round compute latency (s)",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
        )
        self.refusals = Counter(
            "dsv41_drafter_refusals", "Frames or rounds refused", ["status"], registry=self.registry
        )
        self.connections = Gauge("dsv41_drafter_connections", "Open client connections", registry=self.registry)
        self.info = Gauge(
            "dsv41_drafter_info",
            "Worker identities (value 1)",
            ["drafter", "markov", "target", "backend"],
            registry=self.registry,
        )


class DrafterWorker:
    """Serve ``backend`` (an object with ``draft(items) -> Drafts``, ``ids``, ``cfg``, ``backend``,
    ``max_batch``) on ``host:port`` (port 0 = ephemeral; :attr:`address` after :meth:`start`).

    ``target_identity``: the target this drafter serves (hex sha256); a client whose hello names a
    different non-empty target identity is refused (IDENTITY_MISMATCH). ``delay_ms`` injects a
    per-round delay (drills and tests of the client's timeout path).
    """

    def __init__(
        self,
        backend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        target_identity: str = "",
        delay_ms: float = 0.0,
        max_connections: int = 64,
        hello_timeout_s: float = 10.0,
        frame_timeout_s: float = 10.0,
    ) -> None:
        self.backend = backend
        # Connection hygiene (a peer must not hold or bloat the worker): at most
        # ``max_connections`` open at once (more are refused LIMIT and closed); the hello must
        # arrive within ``hello_timeout_s`` of connecting; once a frame's first byte is in, the
        # whole frame must arrive within ``frame_timeout_s`` (slowloris). An idle greeted client
        # may wait between rounds for as long as it likes.
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.frame_timeout_s = frame_timeout_s
        self.target_identity = target_identity or backend.ids.get("target", "")
        self.delay_s = delay_ms / 1000.0
        self.metrics = WorkerMetrics()
        cfg = backend.cfg
        self.hello = P.Hello(
            drafter_identity=backend.ids["drafter"],
            markov_identity=backend.ids["markov"],
            target_identity=self.target_identity or "0" * 64,
            max_batch=backend.max_batch,
            max_k=cfg.max_k,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            top_n=cfg.top_n,
            max_context=cfg.n_ctx,
            backend=backend.backend,
        )
        self.metrics.info.labels(
            self.hello.drafter_identity, self.hello.markov_identity, self.hello.target_identity, backend.backend
        ).set(1)
        self._lock = threading.Lock()
        self._host, self._port = host, port
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        #: Set by :meth:`fail`; the serving loop then stops the worker and exits with ``failure``.
        self.failed = threading.Event()
        self.failure = ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> tuple[str, int]:
        """Bind and serve in a background thread; returns the bound (host, port)."""
        worker = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:  # noqa: D401 - socketserver API
                worker._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        try:
            self._server = Server((self._host, self._port), Handler)
        except OSError as exc:
            raise Dsv41Error(f"drafter serve: cannot listen on {self._host}:{self._port}: {exc}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="drafter-worker", daemon=True
        )
        self._thread.start()
        log.info(
            "drafter worker listening on %s:%d (backend %s, drafter %s, target %s)",
            *self.address,
            self.backend.backend,
            self.hello.drafter_identity[:12],
            self.hello.target_identity[:12],
        )
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); only valid after :meth:`start`."""
        assert self._server is not None
        return self._server.server_address[:2]

    def stop(self) -> None:
        """Stop accepting, close every connection, join the server thread."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._conns_lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def fail(self, reason: str) -> None:
        """Mark the worker failed for good (first reason kept): the serving loop stops it and the
        process exits 1 with ``reason``. Safe from any thread."""
        if not self.failed.is_set():
            self.failure = reason
            log.error("drafter worker failed: %s", reason)
            self.failed.set()

    # ------------------------------------------------------------------ per connection

    def _refuse(self, sock: socket.socket, status: P.Status, message: str, round_id: int = 0) -> None:
        self.metrics.refusals.labels(status.name.lower()).inc()
        log.warning("drafter worker refused a frame: %s: %s", status.name, message)
        try:
            sock.settimeout(self.frame_timeout_s)  # a peer that never reads cannot block us
            P.send_frame(sock, P.Msg.ERROR, message.encode("utf-8")[:4096], round_id=round_id, status=status)
        except OSError:
            pass

    def _next_frame(self, sock: socket.socket, greeted: bool) -> tuple[P.Header, bytes]:
        """Read the next frame under the connection's timeouts and length limits.

        Before the hello: the whole frame within ``hello_timeout_s`` of now, payload at most
        :data:`P.MAX_HELLO_PAYLOAD`. After it: wait for the first byte without limit (an idle
        client is fine; :meth:`stop` shuts the socket down), then the whole frame within
        ``frame_timeout_s``. Raises ``socket.timeout``, ConnectionError, :class:`P.ProtocolError`.
        """
        if not greeted:
            return P.read_frame(sock, deadline=time.monotonic() + self.hello_timeout_s, max_length=P.MAX_HELLO_PAYLOAD)
        sock.settimeout(None)
        if not sock.recv(1, socket.MSG_PEEK):
            raise ConnectionError("peer closed the connection")
        return P.read_frame(sock, deadline=time.monotonic() + self.frame_timeout_s)

    def _handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._conns_lock:
            full = len(self._conns) >= self.max_connections
            if not full:
                self._conns.add(sock)
        if full:
            self._refuse(sock, P.Status.LIMIT, f"worker has {self.max_connections} connections open already")
            try:
                sock.close()
            except OSError:
                pass
            return
        self.metrics.connections.inc()
        greeted = False
        try:
            while True:
                try:
                    head, payload = self._next_frame(sock, greeted)
                except P.ProtocolError as exc:
                    self._refuse(sock, exc.status, str(exc))
                    return  # header-level errors: the stream cannot be resynchronised
                except TimeoutError:
                    why = "no hello" if not greeted else "frame incomplete"
                    limit = self.hello_timeout_s if not greeted else self.frame_timeout_s
                    self._refuse(sock, P.Status.TIMEOUT, f"{why} within {limit:g} s; closing")
                    return
                except (ConnectionError, OSError):
                    return
                t_recv = time.monotonic()
                if head.msg == P.Msg.HELLO_REQ:
                    try:
                        req = P.HelloRequest.decode(payload)
                    except P.ProtocolError as exc:
                        self._refuse(sock, exc.status, str(exc), head.round_id)
                        return
                    if req.target_identity and self.target_identity and req.target_identity != self.target_identity:
                        self._refuse(
                            sock,
                            P.Status.IDENTITY_MISMATCH,
                            f"client target {req.target_identity[:12]} != worker target {self.target_identity[:12]}",
                            head.round_id,
                        )
                        return
                    sock.settimeout(self.frame_timeout_s)
                    P.send_frame(sock, P.Msg.HELLO, self.hello.encode(), round_id=head.round_id)
                    greeted = True
                    continue
                if not greeted:
                    self._refuse(sock, P.Status.NO_HELLO, "the first frame must be HELLO_REQ", head.round_id)
                    return
                if head.msg != P.Msg.ROUND:
                    self._refuse(sock, P.Status.BAD_TYPE, f"unexpected {head.msg.name} from a client", head.round_id)
                    continue
                reply = self._round(sock, head, payload, t_recv)
                if reply is not None:
                    sock.settimeout(self.frame_timeout_s)
                    P.send_frame(sock, P.Msg.DRAFTS, reply, round_id=head.round_id)
        except OSError:
            return
        finally:
            self.metrics.connections.dec()
            with self._conns_lock:
                self._conns.discard(sock)
            try:
                sock.close()
            except OSError:
                pass

    def _round(self, sock: socket.socket, head: P.Header, payload: bytes, t_recv: float) -> bytes | None:
        try:
            rnd = P.Round.decode(payload, max_items=self.backend.max_batch, hidden_size=self.hello.hidden_size)
        except P.ProtocolError as exc:
            self._refuse(sock, exc.status, str(exc), head.round_id)
            return None
        with self._lock:
            if rnd.deadline_ms and (time.monotonic() - t_recv) * 1000.0 > rnd.deadline_ms:
                self._refuse(
                    sock,
                    P.Status.TIMEOUT,
                    f"round {head.round_id} waited past its {rnd.deadline_ms} ms deadline",
                    head.round_id,
                )
                return None
            t0 = time.perf_counter()
            try:
                if self.delay_s:
                    time.sleep(self.delay_s)
                drafts = self.backend.draft(rnd.items)
            except BackendFailed as exc:
                self._refuse(sock, P.Status.INTERNAL, str(exc), head.round_id)
                self.fail(str(exc))
                return None
            except Dsv41Error as exc:
                self._refuse(sock, P.Status.MALFORMED, str(exc), head.round_id)
                return None
            except Exception as exc:  # a backend bug must not kill the worker; report and count it
                log.exception("drafter backend failed")
                self._refuse(sock, P.Status.INTERNAL, f"backend error: {type(exc).__name__}", head.round_id)
                return None
            dt = time.perf_counter() - t0
        self.metrics.rounds.inc()
        self.metrics.items.inc(len(rnd.items))
        self.metrics.drafts.inc(sum(int(t.size) for t in drafts.tokens))
        self.metrics.latency.observe(dt)
        return drafts.encode()


def check_serve_args(listen: str, ready_file: str, target_identity: str) -> tuple[str, int]:
    """The checks every worker makes before loading anything: returns the (host, port) of
    ``listen``; :class:`Dsv41Error` (one line) for a bad URL, a ready-file directory that is missing
    or not writable, or a target identity that is not a lowercase hex sha256."""
    host, port = P.parse_url(listen, listen=True)
    if ready_file:  # check before loading anything, so a typo does not cost a start-up
        rdir = os.path.dirname(os.path.abspath(ready_file))
        if not os.path.isdir(rdir) or not os.access(rdir, os.W_OK):
            raise Dsv41Error(f"drafter serve: --ready-file {ready_file}: directory {rdir} is missing or not writable")
    if target_identity and (len(target_identity) != 64 or any(c not in "0123456789abcdef" for c in target_identity)):
        raise Dsv41Error(f"--target-identity {target_identity!r} is not a lowercase hex sha256")
    return host, port


def check_recorded_target(drafter_dir: str, recorded: str, target_identity: str) -> None:
    """Refuse (:class:`Dsv41Error`) a drafter distilled for another target than ``target_identity``."""
    if target_identity and recorded and recorded != target_identity:
        raise Dsv41Error(
            f"drafter {drafter_dir} was distilled for target {recorded[:12]}, "
            f"not --target-identity {target_identity[:12]}; refusing to serve it"
        )


def run_worker(
    worker: DrafterWorker, *, metrics: str = "", ready_file: str = "", stop_event: threading.Event | None = None
) -> None:
    """Serve ``worker`` until SIGTERM/SIGINT, ``stop_event`` or :meth:`DrafterWorker.fail`: binds
    ``--metrics`` first, starts the worker, writes the ready file, prints the ready line, waits,
    then stops the worker and the metrics server. Raises :class:`Dsv41Error` for a port that cannot
    be bound and, after stopping, with the worker's failure reason when it failed."""
    import signal

    # --metrics is bound before the worker starts (and logs that it listens): a busy or bad
    # --metrics is then the process's one error line
    metrics_http = None
    if metrics:
        from dsv41.httpd import serve_metrics

        mh, _, mp = metrics.rpartition(":")
        if not mp.isdigit():
            raise Dsv41Error(f"--metrics {metrics!r}: expected HOST:PORT")
        try:
            metrics_http = serve_metrics(mh or "127.0.0.1", int(mp), worker.metrics.registry)
        except (OSError, OverflowError) as exc:
            raise Dsv41Error(f"--metrics {metrics}: cannot listen: {exc}") from None
    try:
        worker.start()
    except BaseException:
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()
        raise
    stop = stop_event or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, lambda *_: stop.set())
        except ValueError:  # not the main thread (tests): the stop event is enough
            pass
    try:
        if ready_file:
            from dsv41 import fileio

            fileio.atomic_write(
                ready_file, f"tcp://{worker.address[0]}:{worker.address[1]}\n", "drafter serve --ready-file"
            )
        print(
            f"drafter worker ready on tcp://{worker.address[0]}:{worker.address[1]} "
            f"drafter={worker.hello.drafter_identity} markov={worker.hello.markov_identity} "
            f"target={worker.hello.target_identity}",
            flush=True,
        )
        while not stop.wait(0.2) and not worker.failed.is_set():
            pass
    finally:
        worker.stop()
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()
    if worker.failed.is_set():
        raise Dsv41Error(worker.failure)


def serve(
    drafter_dir: str,
    listen: str,
    *,
    target_identity: str = "",
    device: str = "cpu",
    cuda_graphs: bool = False,
    backend: str = "torch",
    metrics: str = "",
    ready_file: str = "",
    max_batch: int = 64,
    delay_ms: float = 0.0,
    lock_dir: str = "",
    stop_event: threading.Event | None = None,
) -> None:
    """Load the backend, check identities, serve until SIGTERM/SIGINT (or ``stop_event``).

    A CUDA card is locked for the process's life (:mod:`dsv41.drafter.gpulock`, in ``lock_dir``,
    default ``/run/dsv41``), so a second worker, one-card or two-card, cannot take it. Raises
    :class:`Dsv41Error` on bad arguments, a card held by another worker, a drafter trained for
    another target, or a port that cannot be bound.
    """
    import re

    host, port = check_serve_args(listen, ready_file, target_identity)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise Dsv41Error(f"drafter serve: --device {device!r}: expected cpu, cuda or cuda:N")
    locks: list[int] = []
    if device.startswith("cuda"):
        from dsv41.drafter import gpulock, pair

        facts = pair.probe_device(device)
        if not facts.present:
            raise Dsv41Error(f"drafter serve: --device {device}: not present ({facts.visible} CUDA device(s) visible)")
        locks = gpulock.acquire_all(lock_dir or gpulock.DEFAULT_LOCK_DIR, [pair.card_key(facts, 0)])
    try:
        if backend == "torch":
            from dsv41.drafter.model import TorchDrafter

            be = TorchDrafter(drafter_dir, device=device, cuda_graphs=cuda_graphs, max_batch=max_batch)
        elif backend == "exl3":
            from dsv41.drafter.exl3 import Exl3Drafter

            be = Exl3Drafter(drafter_dir, device=device, max_batch=max_batch)
        else:
            raise Dsv41Error(f"drafter serve: unknown backend {backend!r} (torch or exl3)")
        check_recorded_target(drafter_dir, be.ids.get("target", ""), target_identity)
        worker = DrafterWorker(be, host, port, target_identity=target_identity, delay_ms=delay_ms)
        run_worker(worker, metrics=metrics, ready_file=ready_file, stop_event=stop_event)
    finally:
        if locks:
            from dsv41.drafter import gpulock

            gpulock.release(locks)
