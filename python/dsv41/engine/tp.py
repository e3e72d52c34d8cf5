"""Tensor-parallel collectives of the lab engine (torch.distributed; gloo on CPU, NCCL on CUDA).

``Comm`` is what the model calls: ``sum_shards(parts)`` (row-parallel outputs) and
``gather_cols(local)`` (Engram columns). ``LocalComm`` is TP1; ``DistComm`` is TP>1.

Bit-identity TP1 == TP2: each rank computes one partial per virtual shard it owns (same shapes
as TP1 computes them), the ranks all-gather the partials and every rank sums them in shard
order ``((p0 + p1) + p2) ...`` exactly as ``LocalComm`` does, so the result has the same bits.
Control messages (step plans, counters, drain flags) go over a gloo group even when the data
plane is NCCL.

Liveness (docs/engine.md, "Liveness and deadlines"): a rank builds everything slow (weights,
row source, speculator, KV budget) *before* it joins the group (``DistComm(...)`` then
``join()``), so once the group has formed neither rank ever waits for the other longer than
``peer_timeout_s`` (``DSV41_TP_PEER_TIMEOUT_S``):

- rendezvous (``init_process_group``): bounded by the rendezvous timeout (``--rendezvous-timeout``),
  because rank 1 is started first and legitimately waits for rank 0 to appear; rank 0 serves no
  HTTP until it has joined, so its ``/health`` is not 200 and requests are refused at once;
- the groups and a handshake right after it run with ``peer_timeout_s`` (both ranks have just
  answered, so there is no "first command" that may take long);
- every later collective (idle pings every 0.5 s, steps, status exchanges) runs on groups
  created with ``peer_timeout_s``: a peer that stops answering (SIGSTOP, a wedged process, a
  fabric link that drops packets) fails the collective with ``PeerLost`` within that bound.
  gloo enforces the timeout itself; NCCL's watchdog enforces it on CUDA.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import sys

from dsv41.errors import Dsv41Error


def _exit_now(code: int) -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
            pass
    os._exit(code)


def ordered_sum(parts):
    """Sum tensors in list order (the fixed reduction order both TP sizes use)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


class LocalComm:
    """TP1: no peers. ``rank 0``, ``tp 1``."""

    rank = 0
    tp = 1

    def sum_shards(self, parts):
        """Sum of this rank's partial tensors in a fixed order (bit-identical to TP2's sum)."""
        return ordered_sum(parts)

    def gather_cols(self, local, what: str = ""):
        """All ranks' column slices concatenated on dim 1: at TP1 ``local`` is already whole."""
        return local


#: Seconds past the rendezvous timeout + peer timeout before the join watchdog ends the process
#: (torch's own timeouts normally fire first, with their own message).
JOIN_GRACE_S = 2.0


class PeerLost(Dsv41Error):
    """A collective failed: the other rank died or the link broke."""


class DistComm:
    """TP over an initialised default process group plus a gloo control group.

    ``timeout_source``: what a timeout's error line names as the setting of ``peer_timeout_s``
    (the engine's environment variable; the drafter pair sets its ``--peer-timeout``).

    ``DistComm(rank, tp, master, device, timeout_s, peer_timeout_s)`` checks its arguments and
    joins nothing; ``join()`` forms the group (rank 0 hosts the rendezvous store at ``master``,
    ``ADDR:PORT``, so rank 1 may start first and waits up to ``timeout_s`` seconds), creates the
    groups bounded by ``peer_timeout_s`` and exchanges a handshake on them. Build everything slow
    before ``join()``: from then on the peer expects an answer within ``peer_timeout_s``.
    ``DistComm.init(...)`` is construct-and-join. Raises ``Dsv41Error`` for bad arguments or a
    failed rendezvous, ``PeerLost`` when the handshake times out.
    """

    def __init__(
        self,
        rank: int,
        tp: int,
        master: str,
        device: str = "cpu",
        timeout_s: float = 600.0,
        peer_timeout_s: float | None = None,
    ) -> None:
        if not 0 <= rank < tp:
            raise Dsv41Error(f"--rank {rank} is outside [0, {tp})")
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise Dsv41Error(f"--master must be ADDR:PORT, got {master!r}")
        self.rank, self.tp, self.master, self.device = rank, tp, master, device
        self.timeout_s, self.peer_timeout_s = timeout_s, peer_timeout_s
        self.ctrl = self.live_ctrl = self.live_data = None
        self.joined = False
        self.wedged = False  # a collective timed out or failed: the group may be stuck
        self.timeout_source = "DSV41_TP_PEER_TIMEOUT_S"

    @classmethod
    def init(
        cls,
        rank: int,
        tp: int,
        master: str,
        device: str = "cpu",
        timeout_s: float = 600.0,
        peer_timeout_s: float | None = None,
    ) -> DistComm:
        """``DistComm(...)`` then ``join()``; see the class doc."""
        comm = cls(rank, tp, master, device, timeout_s, peer_timeout_s)
        comm.join()
        return comm

    def join(self) -> DistComm:
        """Form the group (gloo on CPU, NCCL + a gloo control group on CUDA) and handshake; see
        the class doc; the whole join is bounded by a watchdog (rendezvous timeout + peer timeout
        + ``JOIN_GRACE_S``) that exits the process with one ``dsv41: error:`` line. Returns
        ``self``."""
        import threading

        # A peer frozen while it holds the rendezvous store (its listening socket still accepts
        # connections) leaves the store client waiting past the rendezvous timeout, and a
        # blocked C++ call cannot be interrupted: a watchdog ends the process with one line.
        bound = self.timeout_s + (self.peer_timeout_s or 0.0) + JOIN_GRACE_S
        watchdog = threading.Timer(bound, self._join_overdue, args=(bound,))
        watchdog.daemon = True
        watchdog.start()
        try:
            return self._join()
        finally:
            watchdog.cancel()

    def _join_overdue(self, bound: float) -> None:
        print(
            f"dsv41: error: rank {self.rank}: cannot join the TP group at {self.master} within {bound:g} s "
            f"(--rendezvous-timeout {self.timeout_s:g} s + DSV41_TP_PEER_TIMEOUT_S + {JOIN_GRACE_S:g} s): the "
            "peer is frozen, wedged or unreachable",
            file=sys.stderr,
        )
        _exit_now(1)

    def _join(self) -> DistComm:
        import torch
        import torch.distributed as dist

        host, _, port = self.master.rpartition(":")
        backend = "nccl" if str(self.device).startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(self.device))
        try:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{host}:{port}",
                rank=self.rank,
                world_size=self.tp,
                timeout=_dt.timedelta(seconds=self.timeout_s),
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise Dsv41Error(
                f"rank {self.rank}: cannot join the TP group at {self.master} within "
                f"{self.timeout_s:g} s (--rendezvous-timeout): "
                f"{(str(exc).splitlines() or [type(exc).__name__])[0]}"
            ) from None
        self.joined = True
        # Both ranks have just answered: from here on, every wait on the peer is the short bound.
        try:
            if self.peer_timeout_s is not None:
                short = _dt.timedelta(seconds=self.peer_timeout_s)
                self.live_ctrl = dist.new_group(backend="gloo", timeout=short)
                self.live_data = dist.new_group(backend=backend, timeout=short) if backend != "gloo" else self.live_ctrl
                self.ctrl = self.live_ctrl
            else:
                self.ctrl = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        except (RuntimeError, ValueError, OSError) as exc:
            self.wedged = True
            raise PeerLost(
                f"rank {self.rank}: the TP peer did not finish forming the groups within "
                f"{self.peer_timeout_s or self.timeout_s:g} s: "
                f"{(str(exc).splitlines() or [type(exc).__name__])[0]}"
            ) from None
        hello = self.all_gather_obj({"hello": self.rank})
        if [h.get("hello") if isinstance(h, dict) else None for h in hello] != list(range(self.tp)):
            raise Dsv41Error(f"rank {self.rank}: unexpected TP handshake {hello!r}")
        return self

    def _ctrl_group(self):
        return self.live_ctrl if self.live_ctrl is not None else self.ctrl

    def _data_group(self):
        return self.live_data  # None: the default group (peer_timeout_s None: the long bound)

    def _guard(self, fn, what: str):
        try:
            return fn()
        except (RuntimeError, OSError, ValueError) as exc:
            self.wedged = True
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
            detail = detail.split("] ", 1)[-1].split(". This is typically", 1)[0]
            if "timed out" in detail.lower() or "timeout" in detail.lower():
                raise PeerLost(
                    f"rank {self.rank}: the TP peer did not answer within "
                    f"{self.peer_timeout_s or 0:g} s ({self.timeout_source}; frozen, wedged or "
                    f"unreachable) during {what}: {detail}"
                ) from None
            raise PeerLost(
                f"rank {self.rank}: lost the TP peer (the other rank died or the link broke) during {what}: {detail}"
            ) from None

    def sum_shards(self, parts):
        """All-gather every rank's partials (list of equal-shape tensors) and sum them in rank
        order (``ordered_sum``), so TP2 adds in the same order as TP1; ``PeerLost`` on failure."""
        import torch
        import torch.distributed as dist

        local = torch.stack(parts).contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.tp)]
        group = self._data_group()
        self._guard(lambda: dist.all_gather(bufs, local, group=group), "all_gather(partials)")
        return ordered_sum([p for b in bufs for p in b.unbind(0)])

    def gather_cols(self, local, what: str = "all_gather(engram columns)"):
        """``[N, C/tp]`` on each rank -> ``[N, C]`` in rank order (vLLM column convention);
        ``PeerLost`` (naming ``what``) on failure."""
        import torch
        import torch.distributed as dist

        local = local.contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.tp)]
        group = self._data_group()
        self._guard(lambda: dist.all_gather(bufs, local, group=group), what)
        return torch.cat(bufs, dim=1)

    def broadcast(self, obj=None):
        """Rank 0 sends ``obj`` to every rank; returns it on all ranks."""
        import torch.distributed as dist

        box = [obj]
        group = self._ctrl_group()
        self._guard(lambda: dist.broadcast_object_list(box, src=0, group=group), "broadcast(command)")
        return box[0]

    def all_gather_obj(self, obj):
        """Each rank contributes ``obj``; returns the list in rank order on every rank."""
        import torch.distributed as dist

        out = [None] * self.tp
        group = self._ctrl_group()
        self._guard(lambda: dist.all_gather_object(out, obj, group=group), "all_gather(status)")
        return out

    def close(self) -> None:
        """Destroy the process group (best effort: never raises). After a failed collective the
        group is left alone: tearing down a group whose peer is frozen can block."""
        import torch.distributed as dist

        if not self.joined:
            return
        if self.wedged:
            # The c10d objects' teardown at interpreter exit talks to the rendezvous store, which
            # lives in rank 0: with rank 0 frozen it blocks for the rendezvous timeout. The
            # process is ending with PeerLost (exit 1) anyway, so end it once the error line is
            # printed (atexit runs after the command's error handling, before that teardown).
            atexit.register(_exit_now, 1)
            return
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a peer died must not mask the real error
            pass
