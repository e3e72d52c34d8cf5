"""What the overlay's CPU tests share (tests/unit/test_overlay_engram.py, test_overlay_worker.py,
test_overlay_capture.py): the synthetic tables (``tabs``), a CPU emulation of vLLM's Engram lookup
kernel and the exact reference rows it is compared with bit for bit, a holdable row source
(``Gate``) and fake CUDA stream/event operations (``StepOps``)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from dsv41.engram import dequant, reader, synthetic
from dsv41.engram.layout import EngramLayout
from dsv41.engram.manifest import load_manifest
from dsv41.engram.rowsource import LocalRowSource, RowSource
from dsv41.engram.server import load_tables
from dsv41.overlay import engram as E
from dsv41.transport import parse_url
from dsv41.transport.server import RowServer

CFG = {
    "engram_layer_ids": [1, 14],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 500,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 229,
    "vocab_size": 260,
}
SEED = 5


@pytest.fixture(scope="module")
def tabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ovl")
    mpath = synthetic.write_synthetic_tables(CFG, d, seed=SEED, chunk_size=1 << 20)
    return load_manifest(mpath), d, EngramLayout.from_config(CFG)


def kernel_on_cpu(w, s, sel, dst, out, n, rows):
    """Emulation of vLLM's ``_engram_lookup_kernel`` (SORTED, BF16 out): owned = 0 <= sel < n;
    value = float(e4m3 byte) * bitcast<float>(scale byte << 23), rounded to bf16; others 0."""
    sel = sel[:rows].long()
    owned = (sel >= 0) & (sel < n)
    local = torch.where(owned, sel, torch.zeros_like(sel))
    vals = w[local].view(torch.float8_e4m3fn).float()
    scale = (s[local].int() << 23).view(torch.float32).repeat_interleave(32, dim=1)
    res = (vals * scale).to(torch.bfloat16)
    res[~owned] = 0
    out.view(-1, w.shape[1])[dst[:rows].long()] = res


def reference(tabs_, layer_id: int, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """float32 [R, 256] holding bf16 values: owned rows via dequant.dequantize(vllm), others 0."""
    manifest, d, layout = tabs_
    flat = ids.reshape(-1).astype(np.int64)
    owned = (flat >= lo) & (flat < hi)
    ref = np.zeros((flat.size, 256), np.float32)
    if owned.any():
        packed = synthetic.synthetic_rows(SEED, layer_id, layout.rows[layout.layer_index(layer_id)], flat[owned])
        ref[owned] = dequant.dequantize(packed, convention="vllm", backend="numpy")[0]
    return ref


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    nan = np.isnan(got) & np.isnan(ref)  # NaN payloads are not compared (0 * inf)
    return bool(np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))


def remote_rows(tabs_, src, layer_id: int, tp: int = 2, rank: int = 0, max_tokens: int = 64, **kw):
    """The overlay's ``RemoteRows`` for ``layer_id`` of rank ``rank`` at TP ``tp`` over ``src``, on CPU."""
    manifest, d, layout = tabs_
    li = layout.layer_index(layer_id)
    c0, _ = layout.columns_for_rank(tp, rank)
    lo, hi = layout.row_range(li, tp, rank)
    return E.RemoteRows(
        src,
        layer_id,
        head_start=c0,
        part=-(-layout.n_columns // tp),
        n_hash_cols=layout.n_columns,
        vocab_start=lo,
        vocab_end=hi,
        dim=256,
        block=32,
        max_tokens=max_tokens,
        device="cpu",
        dequant=kernel_on_cpu,
        rank=rank,
        **kw,
    )


def lookup_ids(tabs_, rr, t: int, seed: int) -> np.ndarray:
    """(t, n_columns) int32 hashed ids for ``rr``: own rows, -1 pads, out-of-range and other ranks' rows."""
    layout = tabs_[2]
    li = layout.layer_index(rr.layer_id)
    rng = np.random.default_rng(seed)
    ids = rng.integers(rr.vocab_start, rr.vocab_end, size=(t, layout.n_columns)).astype(np.int32)
    u = rng.random(ids.shape)
    ids[u < 0.1] = -1
    ids[u > 0.9] = layout.rows[li] + 3
    ids[(u > 0.8) & (u <= 0.9)] = rng.integers(0, layout.rows[li])
    return ids


def exact_rows(tabs_, rr, ids: np.ndarray, out) -> bool:
    """``out`` (t, part, 256) bf16 equals the reference rows of ``ids`` bit for bit."""
    he = min(rr.head_start + rr.part, rr.n_hash_cols)
    mine = np.full((ids.shape[0], rr.part), -1, np.int64)
    mine[:, : he - rr.head_start] = ids[:, rr.head_start : he]
    return same_bits(
        out.float().numpy().reshape(-1, 256), reference(tabs_, rr.layer_id, mine, rr.vocab_start, rr.vocab_end)
    )


def poisoned(t: int, part: int):
    """A (t, part, 256) bf16 output buffer of NaNs (a row left unwritten shows)."""
    return torch.full((t, part, 256), float("nan"), dtype=torch.bfloat16)


# ------------------------------------------------- the worker pipeline (issue 23), on the CPU


class Gate(RowSource):
    """A RowSource over the exact local reader whose calls can be held (``hold``) and that records
    each call with its thread's name: the worker's calls vs the launching thread's."""

    def __init__(self, tabs_, required: bool = False) -> None:
        manifest, d, _ = tabs_
        self.inner = LocalRowSource(reader.LocalRowReader(manifest, d))
        self.required = required
        self.calls: list[tuple[str, tuple, str]] = []
        self.release = __import__("threading").Event()
        self.release.set()
        self.entered = __import__("threading").Event()
        self.fail: BaseException | None = None  # raised once, in the worker thread only
        self.hold_worker_only = False

    def _enter(self, kind: str, layers: tuple) -> None:
        import threading

        name = threading.current_thread().name
        self.calls.append((kind, layers, name))
        worker = name.startswith("dsv41-engram-worker")
        if self.fail is not None and worker:
            exc, self.fail = self.fail, None
            raise exc
        self.entered.set()
        if worker or not self.hold_worker_only:
            assert self.release.wait(30)

    def lookup(self, layer_id, rows, out=None):
        self._enter("lookup", (layer_id,))
        return self.inner.lookup(layer_id, rows, out=out)

    def lookup_layers(self, layer_ids, rows, outs=None):
        self._enter("lookup_layers", tuple(layer_ids))
        return self.inner.lookup_layers(layer_ids, rows, outs)

    def counters(self):
        return self.inner.counters()

    def close(self) -> None:
        self.inner.close()

    def is_required(self) -> bool:
        return self.required


class StepOps:
    """Fake CUDA stream/event operations (device "cpu" buffers): records which thread calls what,
    and holds the ids event of the first job until ``go`` is set (the GPU still busy with the
    hash), so both layers of a step are queued when the worker looks."""

    def __init__(self) -> None:
        import threading

        self.log: list[tuple[str, str, str]] = []
        self.go = threading.Event()
        self.go.set()
        self.capture = False
        self.graphs = False  # no CUDA graphs (tests that want them pass graph_record)
        ops = self

        class Ev:
            def __init__(self, name: str) -> None:
                self.name = name

            def record(self, stream=None) -> None:
                ops._note("record", f"{self.name}@{stream}")

            def synchronize(self) -> None:
                ops._note("synchronize", self.name)
                assert ops.go.wait(30)

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def __str__(self) -> str:
                return self.name

            def wait_event(self, ev) -> None:
                ops._note("wait_event", f"{self.name}<-{ev.name}")

            def synchronize(self) -> None:
                ops._note("stream_synchronize", self.name)

        self.Ev, self.prefetch, self.main = Ev, Stream("prefetch"), Stream("main")
        self.current = self.prefetch
        self.n = 0

    def _note(self, what: str, arg: str) -> None:
        import threading

        self.log.append((threading.current_thread().name, what, arg))

    def current_stream(self):
        return self.current

    def event(self):
        self.n += 1
        return self.Ev(f"ev{self.n}")

    def stream(self, s):
        self._note("stream", str(s))
        return __import__("contextlib").nullcontext()

    def capturing(self) -> bool:
        return self.capture

    def bind_thread(self) -> None:
        self._note("bind_thread", "")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bound to port 0, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def serve_tables(tabs_, port: int) -> RowServer:
    """A started ``RowServer`` of the ``tabs`` fixture's tables on ``tcp://127.0.0.1:port``."""
    manifest, d, _ = tabs_
    tables, _ = load_tables(manifest, d)
    srv = RowServer(tables, [parse_url(f"tcp://127.0.0.1:{port}")])
    srv.start()
    return srv
