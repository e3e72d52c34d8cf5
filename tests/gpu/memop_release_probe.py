"""Device probe of the GPU-side join's hazard (docs/gpu.md, "A GPU-side join
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

``hostflag``: the design the overlay uses, host-mapped words stored by a C thread that
makes no CUDA call (``hostflag``'s docstring); ``N`` > 1 runs N jobs back to back, stores at once:

    for m in launch sync item empty_cache malloc lazy qr; do timeout 25 python3 tests/gpu/memop_release_probe.py hostflag $m; done
    timeout 60 python3 tests/gpu/memop_release_probe.py hostflag empty_cache 300
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
    w = cu.cuStreamWriteValue64_v2
    w.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    q = cu.cuStreamWaitValue64_v2
    q.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(512, 512, device="cuda")
    (a @ a).sum().item()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    b = torch.zeros(256, device="cuda")
    with torch.cuda.graph(g, stream=s2):
        b.add_(1.0)
    torch.cuda.synchronize()
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    dptr = flag.data_ptr()
    junk = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
    del junk  # cached blocks for empty_cache
    torch.cuda.synchronize()
    ticks = [0]
    stop = [False]
    log = []

    def ticker():
        while not stop[0]:
            ticks[0] += 1
            time.sleep(0.001)

    def writer():
        time.sleep(0.3)
        log.append(("writer start", time.monotonic() - t0))
        g.replay()
        log.append(("replayed", time.monotonic() - t0))
        rc = w(s2.cuda_stream, dptr, 1, 0)
        log.append((f"written rc={rc}", time.monotonic() - t0))

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
            torch.cuda.empty_cache()
            s1.synchronize()
        elif mode == "lazy":
            torch.special.erfcx(a).sum()
            s1.synchronize()
        elif mode == "malloc":
            x = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")  # noqa: F841 - the allocation is the probe
            s1.synchronize()
    stop[0] = True
    print(
        f"{mode}: released after {time.monotonic() - t0:.3f} s; ticker ran {ticks[0] - k0} times while blocked; {log}",
        flush=True,
    )


if __name__ == "__main__" and sys.argv[1] != "hostflag":
    main(sys.argv[1])


# ---- the GPU-side join's own pattern (host-mapped words, a no-GIL C thread stores them) ----------
HOSTFLAG_C = r"""
#include <stdint.h>
#include <string.h>
#include <time.h>
static int64_t now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
/* The worker of the GPU-side join's design: poll the ids word (GPU-written) for gen, then per piece wait
   delay_ns, fill that piece's staging with the byte (gen & 255) and release-store its flag. No
   CUDA call. seen[0] = when the ids word was seen, seen[1 + k] = piece k's store (ns, monotonic). */
void serve(volatile uint64_t *ids, volatile uint64_t *flags, int npieces, uint64_t gen, int64_t delay_ns,
           uint8_t *staging, int64_t piece_bytes, int64_t *seen) {
  while (__atomic_load_n(ids, __ATOMIC_ACQUIRE) < gen) { struct timespec s = {0, 20000}; nanosleep(&s, 0); }
  seen[0] = now_ns();
  for (int k = 0; k < npieces; k++) {
    if (delay_ns > 0) { struct timespec s = {delay_ns / 1000000000LL, delay_ns % 1000000000LL}; nanosleep(&s, 0); }
    memset(staging + k * piece_bytes, (int)(gen & 255), (size_t)piece_bytes);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&flags[k], gen, __ATOMIC_RELEASE);
    seen[1 + k] = now_ns();
  }
}
"""


def hostflag(mode: str, loops: int = 1) -> None:
    """The GPU-side join's pattern on CUDA device 0: the launching thread queues on stream ``pre`` a D2H copy
    of ids into pinned memory, ``cuStreamWriteValue64_v2`` of the job's number into a host-mapped
    ids word (``cuMemHostAlloc`` DEVICEMAP, ``cuMemHostGetDevicePointer_v2``), then per piece a
    ``cuStreamWaitValue64_v2`` (GEQ) on that piece's host-mapped flag and a graph (H2D copy of the
    piece's pinned staging), then an event the main stream waits on. A C thread (ctypes: the GIL
    released) polls the ids word, fills each piece's staging 0.3 s later (``loops`` > 1: at once)
    and release-stores its flag: no CUDA call. Meanwhile the launching thread runs ``mode`` on the
    main stream (as ``main``: launch, sync, item, empty_cache, malloc, lazy, qr). Checks that
    every piece's rows on the device are the bytes the thread wrote for that job."""
    import os
    import subprocess
    import tempfile

    import torch

    d = tempfile.mkdtemp()
    with open(os.path.join(d, "hf.c"), "w") as f:
        f.write(HOSTFLAG_C)
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", "-o", os.path.join(d, "hf.so"), os.path.join(d, "hf.c")], check=True
    )
    lib = ctypes.CDLL(os.path.join(d, "hf.so"))
    lib.serve.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    cu = ctypes.CDLL("libcuda.so.1")
    w = cu.cuStreamWriteValue64_v2
    w.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    q = cu.cuStreamWaitValue64_v2
    q.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    ha = cu.cuMemHostAlloc
    ha.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
    gp = cu.cuMemHostGetDevicePointer_v2
    gp.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    words = ctypes.c_void_p()
    assert ha(ctypes.byref(words), 4096, 0x1 | 0x2) == 0  # PORTABLE | DEVICEMAP
    ctypes.memset(words, 0, 4096)
    dwords = ctypes.c_uint64()
    assert gp(ctypes.byref(dwords), words, 0) == 0
    npieces, piece_bytes = 7, 1 << 22
    ids_h, flags_h = words.value, words.value + 64
    ids_d, flags_d = dwords.value, dwords.value + 64
    main, pre = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.set_stream(main)
    staging = torch.zeros(npieces * piece_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(npieces * piece_bytes, dtype=torch.uint8, device="cuda")
    ids_dev = torch.arange(4096, device="cuda")
    ids_pin = torch.empty(4096, dtype=torch.int64, pin_memory=True)
    a = torch.randn(2048, 2048, device="cuda")
    (a @ a).sum().item()
    graphs = []
    for k in range(npieces):
        g = torch.cuda.CUDAGraph()
        sl = slice(k * piece_bytes, (k + 1) * piece_bytes)
        with torch.cuda.graph(g, stream=pre):
            dev[sl].copy_(staging[sl], non_blocking=True)
        graphs.append(g)
    junk = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
    del junk  # cached blocks for empty_cache
    torch.cuda.synchronize()
    ticks, stop = [0], [False]

    def ticker():
        while not stop[0]:
            ticks[0] += 1
            time.sleep(0.001)

    threading.Thread(target=ticker, daemon=True).start()
    bad = 0
    worst = 0.0
    for gen in range(1, loops + 1):
        seen = (ctypes.c_int64 * (npieces + 1))()
        t0 = time.monotonic()
        t0ns = time.monotonic_ns()
        pre.wait_stream(main)
        with torch.cuda.stream(pre):
            ids_pin.copy_(ids_dev, non_blocking=True)
            assert w(pre.cuda_stream, ids_d, gen, 0) == 0
            for k in range(npieces):
                assert q(pre.cuda_stream, flags_d + 8 * k, gen, 0x1) == 0
                graphs[k].replay()
            done = torch.cuda.Event()
            done.record(pre)
        delay = 300_000_000 // npieces if loops == 1 else 0
        th = threading.Thread(
            target=lib.serve,
            args=(ids_h, flags_h, npieces, gen, delay, staging.data_ptr(), piece_bytes, seen),
            daemon=True,
        )
        th.start()
        main.wait_event(done)
        k0 = ticks[0]
        c = a @ a
        if mode == "launch":
            main.synchronize()
        elif mode == "sync":
            torch.cuda.synchronize()
        elif mode == "item":
            c.sum().item()
        elif mode == "empty_cache":
            torch.cuda.empty_cache()
            main.synchronize()
        elif mode == "lazy":
            torch.special.erfcx(a).sum()
            main.synchronize()
        elif mode == "qr":
            torch.linalg.qr(a[:256, :256])
            torch.fft.rfft(a[0])
            main.synchronize()
        elif mode == "malloc":
            x = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
            main.synchronize()
            del x
        main.synchronize()
        dt = time.monotonic() - t0
        worst = max(worst, dt)
        th.join(5)
        got = dev.view(npieces, piece_bytes)
        ok = bool((got == (gen & 255)).all().item())
        bad += not ok
        if loops == 1 or not ok:
            marks = [round((s - t0ns) * 1e-9, 4) for s in seen]
            print(
                f"hostflag {mode} job {gen}: released after {dt:.3f} s; ticker ran {ticks[0] - k0} times while "
                f"blocked; ids seen / piece stores at {marks} s; rows exact {ok}",
                flush=True,
            )
    stop[0] = True
    if loops > 1:
        print(
            f"hostflag {mode} x{loops}: {loops - bad} of {loops} jobs exact; slowest {worst * 1e3:.2f} ms", flush=True
        )


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "hostflag":
    hostflag(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
