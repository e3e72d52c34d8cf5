"""Device probe of the GPU-side join's hazard (issue 23 pass N; docs/gpu.md, "A GPU-side join
was tried and reverted").

Stream s1 waits (``cuStreamWaitValue64_v2``, GEQ) on an 8-byte device flag that a second thread
releases 0.3 s later the way the overlay's worker does: a CUDA-graph replay on s2, then
``cuStreamWriteValue64_v2``. Meanwhile the launching thread runs ``mode`` on s1: ``launch`` (a
matmul, then s1.synchronize()), ``sync`` (torch.cuda.synchronize()), ``item`` (a D2H read),
``empty_cache`` (torch.cuda.empty_cache(): cudaFree of the cached blocks), ``malloc`` (a new 4 GiB
segment: cudaMalloc) or ``lazy`` (a kernel never run in the process: a lazy module load). Prints
when s1 was released and whether a pure-Python ticker ran meanwhile (the GIL was released).
A mode that deadlocks prints nothing: run each under ``timeout``:

    for m in launch sync item empty_cache malloc lazy; do timeout 25 python3 tests/gpu/memop_release_probe.py $m; done
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time


def main(mode: str) -> None:
    """Run one mode (see the module's docstring) on CUDA device 0."""
    import torch

    cu = ctypes.CDLL("libcuda.so.1")
    w = cu.cuStreamWriteValue64_v2; w.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    q = cu.cuStreamWaitValue64_v2; q.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(512, 512, device="cuda"); (a @ a).sum().item(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(); b = torch.zeros(256, device="cuda")
    with torch.cuda.graph(g, stream=s2):
        b.add_(1.0)
    torch.cuda.synchronize()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda"); dptr = flag.data_ptr()
    junk = [torch.empty(1 << 20, device="cuda") for _ in range(4)]; del junk  # cached blocks for empty_cache
    torch.cuda.synchronize()
    ticks = [0]; stop = [False]; log = []
    def ticker():
        while not stop[0]:
            ticks[0] += 1; time.sleep(0.001)
    def writer():
        time.sleep(0.3); log.append(("writer start", time.monotonic() - t0))
        g.replay(); log.append(("replayed", time.monotonic() - t0))
        rc = w(s2.cuda_stream, dptr, 1, 0); log.append((f"written rc={rc}", time.monotonic() - t0))
    threading.Thread(target=ticker, daemon=True).start()
    t0 = time.monotonic()
    assert q(s1.cuda_stream, dptr, 1, 1) == 0
    threading.Thread(target=writer, daemon=True).start()
    with torch.cuda.stream(s1):
        c = a @ a
        k0 = ticks[0]
        if mode == "launch":
            s1.synchronize()
        elif mode == "sync":
            torch.cuda.synchronize()
        elif mode == "item":
            c.sum().item()
        elif mode == "empty_cache":
            torch.cuda.empty_cache(); s1.synchronize()
        elif mode == "lazy":
            torch.special.erfcx(a).sum(); s1.synchronize()
        elif mode == "malloc":
            x = torch.empty(1 << 32, dtype=torch.uint8, device="cuda"); s1.synchronize()
    stop[0] = True
    print(f"{mode}: released after {time.monotonic()-t0:.3f} s; ticker ran {ticks[0]-k0} times while blocked; {log}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
