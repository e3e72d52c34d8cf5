"""Tensor-parallel collectives of the lab engine (torch.distributed; gloo on CPU, NCCL on CUDA).

``Comm`` is what the model calls: ``sum_shards(parts)`` (row-parallel outputs) and
``gather_cols(local)`` (Engram columns). ``LocalComm`` is TP1; ``DistComm`` is TP>1.

Bit-identity TP1 == TP2: each rank computes one partial per virtual shard it owns (same shapes
as TP1 computes them), the ranks all-gather the partials and every rank sums them in shard
order ``((p0 + p1) + p2) ...`` exactly as ``LocalComm`` does, so the result has the same bits.
Control messages (step plans, counters, drain flags) go over a gloo group even when the data
plane is NCCL.

Liveness: the first command (rank 1 waits for it while rank 0 loads and warms up) may take up to
the rendezvous timeout; every later collective runs on groups created with ``peer_timeout_s``
(``DSV41_TP_PEER_TIMEOUT_S``), so a peer that stops answering (SIGSTOP, a wedged process, a fabric
link that drops packets) fails the collective with ``PeerLost`` within that bound instead of the
600 s rendezvous timeout. gloo enforces the timeout itself; NCCL's watchdog enforces it on CUDA.
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

    def gather_cols(self, local):
        """All ranks' column slices concatenated on dim 1: at TP1 ``local`` is already whole."""
        return local


class PeerLost(Dsv41Error):
    """A collective failed: the other rank died or the link broke."""


class DistComm:
    """TP over an initialised default process group plus a gloo control group.

    ``DistComm.init(rank, tp, master, device, timeout_s)`` joins the group; rank 0 hosts the
    rendezvous store at ``master`` (``ADDR:PORT``), so rank 1 may start first and waits up to
    ``timeout_s`` seconds. Raises ``Dsv41Error`` when the rendezvous fails.
    """

    def __init__(self, rank: int, tp: int, ctrl_group, device, live_ctrl=None, live_data=None,
                 peer_timeout_s: float | None = None) -> None:
        self.rank, self.tp, self.ctrl, self.device = rank, tp, ctrl_group, device
        # Groups with the short peer timeout, used from the second command on (see module doc).
        self.live_ctrl, self.live_data, self.peer_timeout_s = live_ctrl, live_data, peer_timeout_s
        self._first_done = False
        self.wedged = False  # a collective timed out or failed: the group may be stuck

    @classmethod
    def init(cls, rank: int, tp: int, master: str, device: str = "cpu", timeout_s: float = 600.0,
             peer_timeout_s: float | None = None) -> "DistComm":
        """Join the TP group (gloo on CPU, NCCL + a gloo control group on CUDA); see class doc.
        ``peer_timeout_s``: the bound of every collective after the first command (``None``:
        ``timeout_s`` throughout)."""
        import torch
        import torch.distributed as dist

        if not 0 <= rank < tp:
            raise Dsv41Error(f"--rank {rank} is outside [0, {tp})")
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise Dsv41Error(f"--master must be ADDR:PORT, got {master!r}")
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        try:
            dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                    world_size=tp, timeout=_dt.timedelta(seconds=timeout_s))
            ctrl = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
            live_ctrl = live_data = None
            if peer_timeout_s is not None:
                short = _dt.timedelta(seconds=peer_timeout_s)
                live_ctrl = dist.new_group(backend="gloo", timeout=short)
                live_data = dist.new_group(backend=backend, timeout=short) if backend != "gloo" else live_ctrl
        except (RuntimeError, ValueError, OSError) as exc:
            raise Dsv41Error(f"rank {rank}: cannot join the TP group at {master}: {exc}") from None
        return cls(rank, tp, ctrl, device, live_ctrl, live_data, peer_timeout_s)

    def _ctrl_group(self):
        return self.live_ctrl if self._first_done and self.live_ctrl is not None else self.ctrl

    def _data_group(self):
        return self.live_data if self._first_done and self.live_data is not None else None

    def _guard(self, fn, what: str):
        try:
            return fn()
        except (RuntimeError, OSError, ValueError) as exc:
            self.wedged = True
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
            detail = detail.split("] ", 1)[-1].split(". This is typically", 1)[0]
            if "timed out" in detail.lower() or "timeout" in detail.lower():
                raise PeerLost(f"rank {self.rank}: the TP peer did not answer within "
                               f"{self.peer_timeout_s or 0:g} s (DSV41_TP_PEER_TIMEOUT_S; frozen, wedged or "
                               f"unreachable) during {what}: {detail}") from None
            raise PeerLost(f"rank {self.rank}: lost the TP peer (the other rank died or the link broke) "
                           f"during {what}: {detail}") from None

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

    def gather_cols(self, local):
        """``[N, C/tp]`` on each rank -> ``[N, C]`` in rank order (vLLM column convention);
        ``PeerLost`` on failure."""
        import torch
        import torch.distributed as dist

        local = local.contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.tp)]
        group = self._data_group()
        self._guard(lambda: dist.all_gather(bufs, local, group=group), "all_gather(engram columns)")
        return torch.cat(bufs, dim=1)

    def broadcast(self, obj=None):
        """Rank 0 sends ``obj`` to every rank; returns it on all ranks."""
        import torch.distributed as dist

        box = [obj]
        group = self._ctrl_group()
        self._guard(lambda: dist.broadcast_object_list(box, src=0, group=group), "broadcast(command)")
        self._first_done = True
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
