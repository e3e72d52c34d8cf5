"""Tensor-parallel collectives of the lab engine (torch.distributed; gloo on CPU, NCCL on CUDA).

``Comm`` is what the model calls: ``sum_shards(parts)`` (row-parallel outputs) and
``gather_cols(local)`` (Engram columns). ``LocalComm`` is TP1; ``DistComm`` is TP>1.

Bit-identity TP1 == TP2: each rank computes one partial per virtual shard it owns (same shapes
as TP1 computes them), the ranks all-gather the partials and every rank sums them in shard
order ``((p0 + p1) + p2) ...`` exactly as ``LocalComm`` does, so the result has the same bits.
Control messages (step plans, counters, drain flags) go over a gloo group even when the data
plane is NCCL.
"""

from __future__ import annotations

import datetime as _dt

from dsv41.errors import Dsv41Error


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

    def __init__(self, rank: int, tp: int, ctrl_group, device) -> None:
        self.rank, self.tp, self.ctrl, self.device = rank, tp, ctrl_group, device

    @classmethod
    def init(cls, rank: int, tp: int, master: str, device: str = "cpu", timeout_s: float = 600.0) -> "DistComm":
        """Join the TP group (gloo on CPU, NCCL + a gloo control group on CUDA); see class doc."""
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
        except (RuntimeError, ValueError, OSError) as exc:
            raise Dsv41Error(f"rank {rank}: cannot join the TP group at {master}: {exc}") from None
        return cls(rank, tp, ctrl, device)

    def _guard(self, fn, what: str):
        try:
            return fn()
        except (RuntimeError, OSError, ValueError) as exc:
            detail = (str(exc).splitlines() or [type(exc).__name__])[0]
            detail = detail.split("] ", 1)[-1].split(". This is typically", 1)[0]
            raise PeerLost(f"rank {self.rank}: lost the TP peer (the other rank died or the link broke) "
                           f"during {what}: {detail}") from None

    def sum_shards(self, parts):
        """All-gather every rank's partials (list of equal-shape tensors) and sum them in rank
        order (``ordered_sum``), so TP2 adds in the same order as TP1; ``PeerLost`` on failure."""
        import torch
        import torch.distributed as dist

        local = torch.stack(parts).contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.tp)]
        self._guard(lambda: dist.all_gather(bufs, local), "all_gather(partials)")
        return ordered_sum([p for b in bufs for p in b.unbind(0)])

    def gather_cols(self, local):
        """``[N, C/tp]`` on each rank -> ``[N, C]`` in rank order (vLLM column convention);
        ``PeerLost`` on failure."""
        import torch
        import torch.distributed as dist

        local = local.contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.tp)]
        self._guard(lambda: dist.all_gather(bufs, local), "all_gather(engram columns)")
        return torch.cat(bufs, dim=1)

    def broadcast(self, obj=None):
        """Rank 0 sends ``obj`` to every rank; returns it on all ranks."""
        import torch.distributed as dist

        box = [obj]
        self._guard(lambda: dist.broadcast_object_list(box, src=0, group=self.ctrl), "broadcast(command)")
        return box[0]

    def all_gather_obj(self, obj):
        """Each rank contributes ``obj``; returns the list in rank order on every rank."""
        import torch.distributed as dist

        out = [None] * self.tp
        self._guard(lambda: dist.all_gather_object(out, obj, group=self.ctrl), "all_gather(status)")
        return out

    def close(self) -> None:
        """Destroy the process group (best effort: never raises)."""
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a peer died must not mask the real error
            pass
