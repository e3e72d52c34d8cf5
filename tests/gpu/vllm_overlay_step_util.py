"""The step benchmark's stand-in model (tests/gpu/vllm_overlay_step_bench.py, issue 23): one
decoder layer of chained bf16 matmuls (``Layer``), its calibration to a GPU time (``calibrate``)
and the stand-in of ``DeepseekV4Model.forward`` for one arm at one token count (``Forward``:
PIECEWISE segments for decode, eager for the prefill chunk), vLLM's Engram modules for it
(``build_engrams``), the bit-for-bit check of both arms' staged rows (``check_rows``) and ``pct``. Split out of the benchmark to keep
both files under the repository's 600-line limit."""

from __future__ import annotations

import time

import numpy as np

import vllm_overlay_util as Q


class Layer:
    """One stand-in decoder layer: ``n`` chained bf16 [M, K] x [K, K] matmuls (ping-pong buffers)."""

    def __init__(self, torch, n: int, m: int = 4096, k: int = 4096) -> None:
        self.n = n
        g = torch.Generator(device="cuda").manual_seed(1)
        self.w = torch.randn((k, k), device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
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


class Forward:
    """The stand-in forward of one arm at one T (see the module docstring)."""

    def __init__(self, torch, engrams, hash_buf, t: int, layers: list, engram_at: dict, graphs: bool) -> None:
        self.torch, self.engrams, self.hash_buf, self.t = torch, engrams, hash_buf, t
        self.layers, self.engram_at, self.graphs = layers, engram_at, graphs
        self.sink = torch.zeros((), device="cuda", dtype=torch.float32)
        self.stall = {
            li: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for li in engram_at
        }
        # eager steps (the prefill chunk): layer 0 between two main-stream events, and the
        # launching thread's host times (time.monotonic_ns) around the starts and the joins
        self.l0 = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self.host_ns: dict = {}
        self.segments: list = []  # ("graph", CUDAGraph) | ("eager", fn)
        self.captured = False

    def _prepare(self) -> None:
        self.host_ns["prepare0"] = time.monotonic_ns()
        for e in self.engrams:
            e.prepare_embeddings(self.hash_buf[: self.t, e.layer_hash_index])
        self.host_ns["prepare1"] = time.monotonic_ns()

    def _finish(self, li: int) -> None:
        e = self.engram_at[li]
        a, b = self.stall[li]
        a.record()
        self.host_ns[f"join0_{li}"] = time.monotonic_ns()
        e._ready_rows(self.t)
        self.host_ns[f"join1_{li}"] = time.monotonic_ns()
        b.record()

    def _layer(self, li: int) -> None:
        e = self.engram_at.get(li)
        if e is not None:  # the Engram layer reads every staged row (vLLM: wkv over them)
            self.sink.add_(e.staged_rows[: self.t].float().sum())
        if li == 0 and not self.graphs:
            self.l0[0].record()
            self.layers[0]()
            self.l0[1].record()
            return
        self.layers[li]()

    def plan(self) -> list:
        seq = []
        if self.engrams:
            seq.append(("eager", self._prepare))
        for li in range(len(self.layers)):
            if li in self.engram_at:
                seq.append(("eager", lambda li=li: self._finish(li)))
            seq.append(("layer", lambda li=li: self._layer(li)))
        return seq

    def capture(self, capture_flag: dict) -> None:
        """vLLM's breakable capture, as its eager breaks do it: graph segments captured, the
        eager functions run between them with the capture flag up."""
        torch = self.torch
        for _kind, fn in self.plan():  # warm-up (cuBLAS handles, Triton) outside any capture
            fn()
        Q.sync_probe(torch, f"T={self.t} first step")  # synchronizes: a worker-side capture failed here on the GPU
        capture_flag["on"] = True
        try:
            for kind, fn in self.plan():
                if kind == "layer":
                    g = torch.cuda.CUDAGraph()
                    g.capture_begin()
                    fn()
                    g.capture_end()
                    self.segments.append(("graph", g))
                else:
                    fn()
                    self.segments.append(("eager", fn))
        finally:
            capture_flag["on"] = False
        torch.cuda.synchronize()
        self.captured = True

    def __call__(self) -> None:
        if self.graphs:
            for kind, x in self.segments:
                x.replay() if kind == "graph" else x()
        else:
            for _, fn in self.plan():
                fn()


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


def build_engrams(eng, vl, mcfg, torch, stream):
    cfg = Q.ns(hidden_size=64, hc_mult=4, rms_norm_eps=1e-6, **vars(mcfg))
    with torch.device("cuda"):
        return [
            eng.Engram(cfg, None, vl, li, False, f"model.layers.{vl.layer_ids[li]}.engram", prefetch_stream=stream)
            for li in range(len(vl.layer_ids))
        ]


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
        for x, y in zip(got["uva"], got["overlay"], strict=False):
            ok &= bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))
            rows += x.shape[0] * x.shape[1]
    return {"bit_exact": ok, "rows": rows}
