"""The two-card drafter worker: ``dsv41 drafter serve --cards 2 --devices cuda:0,cuda:1``.

One process per card. The command's process is rank 0: it makes the pair checks
(:mod:`dsv41.drafter.pair`), locks both cards for its life (:mod:`dsv41.drafter.gpulock`; rank 1
inherits the second card's lock descriptor, so the card stays locked while either process lives),
starts rank 1 (``python -m dsv41.drafter.worker_tp --ctrl-fd N``, an internal entry), and serves the
one-card worker's protocol (:class:`~dsv41.drafter.worker.DrafterWorker`: same hello, identities,
limits and backend name ``torch``) with :class:`PairDrafter` as its backend. The drafter's weights
are split column-parallel (:mod:`dsv41.drafter.tp_model`); the collectives run on
``dsv41.engine.tp.DistComm`` (gloo on CPU, NCCL on CUDA) bounded by ``--peer-timeout``.

Rank 0 -> rank 1 control: a private socket pair (no port). Rank 0 sends a setup message (JSON),
rank 1 loads its shard and answers ready (or its error line); then per round rank 0 sends the
round's arrays (:func:`dsv41.drafter.model.round_arrays`) and both run the sharded forward. Rank 1
waits for a round without any timeout (an idle worker is fine) and ends on the socket's EOF
(rank 0 gone), a STOP, or a failed collective; it ignores SIGINT/SIGTERM (rank 0 stops it).

Failure: a collective that fails (rank 1 killed: at once; rank 1 frozen: after ``--peer-timeout``)
or rank 1 exiting makes the round INTERNAL and the worker end with one error line, exit 1: the
Sparks' clients fail closed to target-only drafting and reconnect after the restarted worker's
readiness. Rank 1 is killed (by its pid) if it does not stop within 5 s.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import threading

import numpy as np

from dsv41.errors import Dsv41Error

log = logging.getLogger("dsv41.drafter.worker")

#: Round message header on the control socket: magic, op, batch, k.
_CTRL = struct.Struct("<4sIII")
_MAGIC = b"DSTP"
OP_DRAFT, OP_STOP = 1, 2
_LEN = struct.Struct("<I")
#: Seconds rank 1 may take to load its shard and answer the setup; and to join the group after.
READY_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0


# ---------------------------------------------------------------------------------------- wire


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the other rank closed the control channel")
        buf += chunk
    return bytes(buf)


def _send_json(sock: socket.socket, obj: dict) -> None:
    from dsv41 import codec

    body = codec.dumps_json(obj).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_json(sock: socket.socket) -> dict:
    from dsv41 import codec

    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > 1 << 16:
        raise ConnectionError(f"control message of {n} bytes")
    obj = codec.loads_json(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ConnectionError("control message is not a JSON object")
    return obj


def _round_layout(cfg, b: int, k: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    return [
        ("hid", np.dtype("<f4"), (b, cfg.hidden_size)),
        ("ctx", np.dtype("<i8"), (b, cfg.n_ctx)),
        ("inv", np.dtype("<f4"), (b,)),
        ("u", np.dtype("<f4"), (b, k)),
    ]


def send_round(sock: socket.socket, cfg, hid, ctx, inv, u, k: int) -> None:
    """Send one round's arrays to rank 1 (``u`` cut to ``k`` columns)."""
    b = hid.shape[0]
    arrays = {"hid": hid, "ctx": ctx, "inv": inv, "u": u[:, :k]}
    parts = [_CTRL.pack(_MAGIC, OP_DRAFT, b, k)]
    for name, dt, shape in _round_layout(cfg, b, k):
        parts.append(np.ascontiguousarray(arrays[name], dtype=dt).reshape(shape).tobytes())
    sock.sendall(b"".join(parts))


def recv_round(sock: socket.socket, cfg, max_batch: int):
    """Read the next control message: ``None`` for STOP, else ``(hid, ctx, inv, u, k)``. Raises
    ConnectionError on EOF or a malformed header."""
    magic, op, b, k = _CTRL.unpack(_recv_exact(sock, _CTRL.size))
    if magic != _MAGIC:
        raise ConnectionError("bad control magic")
    if op == OP_STOP:
        return None
    if op != OP_DRAFT or not 1 <= b <= max_batch or not 1 <= k <= cfg.max_k:
        raise ConnectionError(f"bad control message (op {op}, batch {b}, k {k})")
    out = {}
    for name, dt, shape in _round_layout(cfg, b, k):
        raw = bytearray(_recv_exact(sock, dt.itemsize * int(np.prod(shape))))  # writable: torch shares it
        out[name] = np.frombuffer(raw, dtype=dt).reshape(shape)
    return out["hid"], out["ctx"], out["inv"], out["u"], k


def _loopback_env(device: str) -> None:
    """Both ranks live on one host: the group's sockets stay on loopback unless the operator chose."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device.startswith("cuda"):
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(drafter_dir: str, comm, device: str):
    from dsv41.drafter.model import load_model
    from dsv41.drafter.tp_model import ShardedDrafter

    cfg, model = load_model(drafter_dir, "cpu")
    return ShardedDrafter(cfg, model.state_dict(), comm, device)


# ---------------------------------------------------------------------------------------- rank 0


class PairDrafter:
    """The worker's backend on rank 0: ``draft(items) -> Drafts`` over the pair, with the one-card
    :class:`~dsv41.drafter.model.TorchDrafter`'s attributes (``ids``, ``cfg``, ``backend``
    ``"torch"``, ``max_batch``). After a failed collective every call raises
    :class:`~dsv41.drafter.worker.BackendFailed` (the pair's group cannot be trusted again)."""

    backend = "torch"

    def __init__(self, shard, ctrl: socket.socket, ids: dict, max_batch: int, threads: int = 1) -> None:
        self.shard, self.ctrl, self.ids, self.max_batch = shard, ctrl, ids, max_batch
        self.cfg = shard.cfg
        self.broken = ""
        self.threads = threads
        self._local = threading.local()

    def draft(self, items):
        """Draft for a batch of RoundItems (see :class:`PairDrafter`)."""
        from dsv41.drafter.model import drafts_of, round_arrays
        from dsv41.drafter.protocol import Drafts
        from dsv41.drafter.worker import BackendFailed
        from dsv41.engine.tp import PeerLost

        cfg = self.cfg
        if self.broken:
            raise BackendFailed(self.broken)
        if not items:
            return Drafts([], [], [], cfg.top_n)
        if len(items) > self.max_batch:
            raise Dsv41Error(f"drafter: batch of {len(items)} > max_batch {self.max_batch}")
        ctx, hid, inv, u, k = round_arrays(cfg, items)
        b = len(items)
        if k == 0:
            z = np.zeros((b, 0, cfg.top_n))
            return drafts_of(cfg, items, np.zeros((b, 0), np.int64), z.astype(np.int64), z.astype(np.float32))
        if not getattr(self._local, "tuned", False):
            # each connection's thread computes its rounds: give it the same intra-op thread count
            # as rank 1's main thread, so both ranks run the same kernels
            import torch

            torch.set_num_threads(self.threads)
            self._local.tuned = True
        try:
            send_round(self.ctrl, cfg, hid, ctx, inv, u, k)
            toks, ids, probs = self.shard.draft(hid, ctx, inv, u, k)
        except (OSError, PeerLost) as exc:
            self.broken = (
                f"drafter pair: {exc}" if isinstance(exc, PeerLost) else f"drafter pair: rank 1 is gone: {exc}"
            )
            raise BackendFailed(self.broken) from None
        return drafts_of(cfg, items, toks, ids, probs)


def serve_pair(
    drafter_dir: str,
    listen: str,
    devices: list[str],
    *,
    target_identity: str = "",
    metrics: str = "",
    ready_file: str = "",
    max_batch: int = 64,
    delay_ms: float = 0.0,
    threads: int = 1,
    lock_dir: str = "",
    peer_timeout_s: float = 5.0,
    probe=None,
    probe_peer=None,
) -> None:
    """Check the pair, lock both cards, start rank 1, serve until SIGTERM/SIGINT or a lost rank.

    ``devices``: two device names (:func:`dsv41.drafter.pair.parse_devices`); ``probe`` /
    ``probe_peer``: the device-fact readers (default :func:`~dsv41.drafter.pair.probe_device`,
    :func:`~dsv41.drafter.pair.probe_peer`; tests inject facts). Raises :class:`Dsv41Error` (one
    line) for bad arguments, an unsafe pair, a card held by another worker (naming its pid), a
    drafter for another target, a rank 1 that cannot start, or a lost rank while serving.
    """
    from dsv41.drafter import gpulock, pair
    from dsv41.drafter.model import identities, load_config
    from dsv41.drafter.worker import DrafterWorker, check_recorded_target, check_serve_args, run_worker
    from dsv41.engine.tp import DistComm

    host, port = check_serve_args(listen, ready_file, target_identity)
    if not 0 < peer_timeout_s <= 3600:
        raise Dsv41Error(f"drafter serve: --peer-timeout {peer_timeout_s:g}: expected seconds in (0, 3600]")
    facts = [(probe or pair.probe_device)(d) for d in devices]
    peer = (probe_peer or pair.probe_peer)(*devices) if all(f.present for f in facts) else None
    for line in pair.check_pair(facts, peer):
        log.warning("%s", line)
    cfg = load_config(drafter_dir)
    ids = identities(drafter_dir)
    check_recorded_target(drafter_dir, ids.get("target", ""), target_identity)
    locks = gpulock.acquire_all(
        lock_dir or gpulock.DEFAULT_LOCK_DIR, [pair.card_key(f, i) for i, f in enumerate(facts)]
    )
    ours, theirs = socket.socketpair()
    proc = comm = backend = None
    stopping = threading.Event()
    try:
        _loopback_env(devices[0])
        # a port taken between this probe and the store's bind fails the join with one line
        master = f"127.0.0.1:{_free_port()}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsv41.drafter.worker_tp", "--ctrl-fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(), locks[1]),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        log.info(
            "drafter pair: rank 1 is pid %d on %s (rank 0: pid %d on %s)", proc.pid, devices[1], os.getpid(), devices[0]
        )
        setup = {
            "drafter": str(drafter_dir),
            "device": devices[1],
            "master": master,
            "threads": threads,
            "peer_timeout_s": peer_timeout_s,
            "max_batch": max_batch,
        }
        _send_json(ours, setup)
        comm = DistComm(0, 2, master, devices[0], timeout_s=JOIN_TIMEOUT_S, peer_timeout_s=peer_timeout_s)
        comm.timeout_source = "--peer-timeout"
        shard = _shard(drafter_dir, comm, devices[0])  # while rank 1 loads its own
        if shard.cfg.to_json() != cfg.to_json():
            raise Dsv41Error(f"drafter pair: {drafter_dir} changed while starting; start again")
        rank1_bytes = _wait_ready(ours)
        log.info(
            "drafter pair: weights per card: rank 0 %.1f MiB on %s, rank 1 %.1f MiB on %s",
            shard.shard_bytes() / 2**20,
            devices[0],
            rank1_bytes / 2**20,
            devices[1],
        )
        comm.join()
        backend = PairDrafter(shard, ours, ids, max_batch, threads)
        worker = DrafterWorker(backend, host, port, target_identity=target_identity, delay_ms=delay_ms)
        _warm_up(backend)
        threading.Thread(target=_watch, args=(proc, worker, stopping), name="drafter-rank1", daemon=True).start()
        run_worker(worker, metrics=metrics, ready_file=ready_file)
    finally:
        stopping.set()
        if proc is not None:
            _stop_rank1(proc, ours, grace_s=0.5 if backend is not None and backend.broken else STOP_GRACE_S)
        ours.close()
        if comm is not None:
            comm.close()
        gpulock.release(locks)


def _wait_ready(ours: socket.socket) -> int:
    """Rank 1's answer to the setup: it has loaded its shard (or says why it cannot); returns the
    bytes of weights it holds."""
    ours.settimeout(READY_TIMEOUT_S)
    try:
        answer = _recv_json(ours)
    except (OSError, ConnectionError, ValueError) as exc:
        raise Dsv41Error(f"drafter pair: rank 1 did not start ({exc}); its error is on stderr above") from None
    finally:
        ours.settimeout(None)
    if not answer.get("ok"):
        raise Dsv41Error(f"drafter pair: rank 1 refused to start: {answer.get('error', '?')}")
    return int(answer.get("shard_bytes", 0))


def _warm_up(backend: PairDrafter) -> None:
    """One round through the pair before serving: a broken pair fails here, not on a Spark's round,
    and NCCL's lazily made communicators are made."""
    from dsv41.drafter.protocol import RoundItem

    cfg = backend.cfg
    item = RoundItem("warm-up", np.zeros(1, np.int64), np.zeros(cfg.hidden_size, np.float32), cfg.max_k)
    backend.draft([item])


def _watch(proc: subprocess.Popen, worker, stopping: threading.Event) -> None:
    """Rank 1 exiting while rank 0 serves ends the worker (``worker.fail``)."""
    rc = proc.wait()
    if not stopping.is_set():
        worker.fail(f"drafter pair: rank 1 (pid {proc.pid}) exited with code {rc}; the pair cannot draft")


def _stop_rank1(proc: subprocess.Popen, ours: socket.socket, grace_s: float) -> None:
    """STOP and close the control channel; kill rank 1 (by its pid) if it lingers."""
    try:
        ours.settimeout(1.0)
        ours.sendall(_CTRL.pack(_MAGIC, OP_STOP, 0, 0))
    except OSError:
        pass
    try:
        ours.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("drafter pair: rank 1 (pid %d) did not stop within %g s; killing it", proc.pid, grace_s)
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------- rank 1


def follower(ctrl: socket.socket) -> int:
    """Rank 1's life: setup, load, ready, join, then rounds until STOP / EOF; returns the exit
    code (0 stopped, 1 failed: the error line is printed to stderr)."""
    import signal

    import torch

    from dsv41.engine.tp import DistComm, PeerLost

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        setup = _recv_json(ctrl)
    except (OSError, ConnectionError, ValueError):
        return 0  # rank 0 went away before the setup: nothing to do
    comm = None
    try:
        torch.set_num_threads(int(setup["threads"]))
        device = str(setup["device"])
        _loopback_env(device)
        comm = DistComm(1, 2, str(setup["master"]), device, JOIN_TIMEOUT_S, float(setup["peer_timeout_s"]))
        comm.timeout_source = "--peer-timeout"
        shard = _shard(str(setup["drafter"]), comm, device)
        max_batch = int(setup["max_batch"])
    except (Dsv41Error, KeyError, ValueError, TypeError) as exc:
        _send_json(ctrl, {"ok": False, "error": str(exc)})
        return 1
    _send_json(ctrl, {"ok": True, "shard_bytes": shard.shard_bytes()})
    try:
        comm.join()
        while True:
            msg = recv_round(ctrl, shard.cfg, max_batch)
            if msg is None:
                return 0
            hid, ctx, inv, u, k = msg
            shard.draft(hid, ctx, inv, u, k)
    except ConnectionError:
        return 0  # rank 0 closed the channel: it is gone or stopping
    except (PeerLost, Dsv41Error) as exc:
        print(f"dsv41: error: drafter pair: {exc}", file=sys.stderr, flush=True)
        comm.close()
        return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m dsv41.drafter.worker_tp --ctrl-fd N``: rank 1 (started by rank 0 only)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "--ctrl-fd" or not args[1].isdigit():
        print("dsv41: error: dsv41.drafter.worker_tp is rank 1 of `dsv41 drafter serve --cards 2`", file=sys.stderr)
        return 2
    try:
        ctrl = socket.socket(fileno=int(args[1]))
    except OSError as exc:
        print(f"dsv41: error: drafter pair rank 1: --ctrl-fd {args[1]}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return follower(ctrl)


if __name__ == "__main__":
    sys.exit(main())
