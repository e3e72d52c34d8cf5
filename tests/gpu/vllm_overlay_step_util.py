"""Pieces of the step benchmark (tests/gpu/vllm_overlay_step_bench.py): the stand-in decoder
layer and its calibration, the overlay tables' join per arm (issue 23 pass N: the GPU-side join
and the host join side by side) and the release event of layer 1's flag, the step's ids and the
bit-for-bit row check of the uva and overlay forwards."""

from __future__ import annotations

import numpy as np

import vllm_overlay_util as Q


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


class Layer:
    """One stand-in decoder layer: ``n`` chained bf16 [M, K] x [K, K] matmuls (ping-pong buffers)."""

    def __init__(self, torch, n: int, m: int = 4096, k: int = 4096) -> None:
        self.n = n
        g = torch.Generator(device="cuda").manual_seed(1)
        self.w = (torch.randn((k, k), device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5)
        self.a = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=g)
        self.b = torch.empty_like(self.a)
        self.torch = torch

    def __call__(self) -> None:
        mm = self.torch.matmul
        a, b = self.a, self.b
        for _ in range(self.n):
            mm(a, self.w, out=b)
            a, b = b, a


def calibrate(torch, target_ms: float) -> tuple[int, float]:
    """Matmuls per layer for ``target_ms`` of GPU time, and the measured ms of one matmul."""
    lay = Layer(torch, 20)
    for _ in range(3):
        lay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        lay()
    e1.record()
    torch.cuda.synchronize()
    one = e0.elapsed_time(e1) / 100
    return max(1, round(target_ms / one)), one


def set_join(ovl, arm: str) -> None:
    """The overlay tables' join for ``arm``: the host join for ``overlay_host_join``, else the
    GPU-side join (``RemoteRows.gpu_join``, where the device supports it)."""
    for o in ovl:
        o.embed_tokens._dsv41.gpu_join = arm != "overlay_host_join"


def release_event(torch, rr, off: bool = False):
    """A timing event recorded on the prefetch stream right after each of ``rr``'s flag writes
    (``ret_gpu_to_b``); None where the table has no device flag. ``off``: no more records."""
    flag = rr._flag
    if flag is None:
        return None
    if off:
        flag.set_release_event(None)
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()  # created (its handle), before the worker records it
    torch.cuda.synchronize()
    flag.set_release_event(ev)
    return ev


def step_ids(torch, rng, t: int, layout, own):
    """int32 [t, n_layers, 24] on the GPU: each Engram layer's ids drawn around its own rank range."""
    per = [Q.random_ids(rng, t, layout, li, e.embed_tokens.n_hash_cols, e.embed_tokens.vocab_start_idx,
                        e.embed_tokens.vocab_end_idx) for li, e in enumerate(own)]
    return torch.from_numpy(np.stack(per, axis=1)).cuda()


def check_rows(torch, fw, sets, hash_buf, t, own, ovl) -> dict:
    """Every id set through the uva and overlay forwards (the timed path); staged rows of both
    Engram layers compared bit for bit."""
    ok, rows = True, 0
    for s in sets:
        got = {}
        for arm in ("uva", "overlay"):
            hash_buf[:t].copy_(s)
            fw[arm]()
            torch.cuda.synchronize()
            engs = own if arm == "uva" else ovl
            got[arm] = [e.staged_rows[:t].clone() for e in engs]
        for x, y in zip(got["uva"], got["overlay"]):
            ok &= bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
            rows += x.shape[0] * x.shape[1]
    return {"bit_exact": ok, "rows": rows}
