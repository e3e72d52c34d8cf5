"""Remote Engram rows inside vLLM's ``ParallelEngramEmbedding`` (vLLM 0.33.0, see
``vllm_contract.json``).

What changes in vLLM when the overlay is active (``DSV41_ENGRAM_REMOTE`` set):

* ``ParallelEngramEmbedding._allocate_weights`` returns zero-row tensors and the parameters get
  a weight loader that drops the checkpoint's table tensors: no pinned host table is allocated
  or loaded (vLLM 0.33.0 would pin about 94 GiB per rank at TP2).
* ``ParallelEngramEmbedding.lookup(indices, out)`` (called by ``Engram._start_prefetch``, an
  ``eager_break_during_capture`` function, so it re-runs at every PIECEWISE replay) becomes:
  the rank's ids ``indices[:, head_start:head_start+part]`` are copied to a pinned host buffer,
  masked exactly as vLLM's kernel masks them (ids outside ``[vocab_start_idx, vocab_end_idx)``,
  ``-1`` and padded heads give zero rows), the others go through ``RowSource.lookup`` (remote,
  exact local fallback, required mode) into the same pinned buffer, which reaches the GPU in
  one H2D copy (row selectors + packed 264-byte rows), and vLLM's own ``_engram_lookup_kernel``
  (SORTED mode, BF16 output) dequantizes into ``staged_rows``: values are bit-identical to
  vLLM's local path because the arithmetic is vLLM's own kernel on the same bytes.
* ``Engram._create_embedding`` tells the embedding its model layer id (the row source keys
  tables by layer id, vLLM by hash index).

Refusals at model construction (always, since the rows would be stale or wrong): a FULL CUDA
graph decode (``FULL``, ``FULL_DECODE_ONLY``, ``FULL_AND_PIECEWISE``: the eager-break function
is captured once), PIECEWISE without breakable graphs (the fetch would sit inside a compiled
piece), and the specialized decode (``decode_backend: latency_specialized``, FULL graphs).
Structural mismatches (GPU tables, Engram DP sharing, ranges that differ from the dsv41 layout
or the contract): refused in required mode, otherwise that table stays on vLLM's own path with
one log line.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from dsv41.errors import ConfigError, Dsv41Error
from dsv41.overlay import contract as C
from dsv41.overlay import settings as S

log = logging.getLogger("dsv41.overlay")

ROW_BYTES = 264
#: Seconds between two counter reports (log line + JSON file) of one rank.
REPORT_EVERY_S = 60.0
_layer: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("dsv41_engram_layer", default=None)
_sources: dict[tuple, Any] = {}
_sources_lock = threading.Lock()


class OverlayRefused(Dsv41Error):
    """vLLM's configuration cannot serve correct rows through the overlay."""


def plan_rows(ids: np.ndarray, vocab_start: int, vocab_end: int, sel_out: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Mask one rank's ids the way vLLM's ``_engram_lookup_kernel`` does and plan the fetch.

    ``ids``: int32/int64 ``[R]`` (the rank's ``[T, part]`` ids flattened, padded heads = -1).
    Returns ``(sel, fetch)``: ``sel`` int32 ``[R]`` = index into ``fetch`` for owned ids
    (``vocab_start <= id < vocab_end``), -1 for the others (their output rows are zeros, as in
    the kernel); ``fetch`` int64 ``[n]`` = owned ids in request order (global row ids of the
    layer's table).  ``sel_out``: optional int32 ``[R]`` buffer to write ``sel`` into.
    """
    ids = np.asarray(ids).reshape(-1)
    owned = (ids >= vocab_start) & (ids < vocab_end)
    fetch = ids[owned].astype(np.int64)
    sel = np.full(ids.shape, -1, np.int32) if sel_out is None else sel_out
    if sel_out is not None:
        sel.fill(-1)
    sel[owned] = np.arange(fetch.shape[0], dtype=np.int32)
    return sel, fetch


class RemoteRows:
    """One Engram table's rank-local rows through a RowSource, staged for vLLM's kernel.

    ``source``: RowSource with ``lookup(layer_id, rows, out=None)``; ``layer_id``: model layer;
    ranges as in vLLM's ``ParallelEngramEmbedding`` (``head_start``, ``part`` =
    ``part_n_hash_cols``, ``n_hash_cols``, ``vocab_start``, ``vocab_end``); ``dim`` (256) and
    ``block`` (32); ``max_tokens``: largest T (``max_num_batched_tokens``); ``device``: where
    ``out`` lives; ``dequant(w, s, sel, dst, out, n, rows)``: the kernel launch (vLLM's
    ``_engram_lookup_kernel`` in SORTED mode on CUDA; tests pass an emulation on CPU).
    Buffers: pinned host ``[rows*4 + rows*264]`` bytes and the same on the device, plus the
    split weight ``[rows, dim]`` and scale ``[rows, dim/block]`` tables the kernel reads.
    """

    def __init__(self, source: Any, layer_id: int, *, head_start: int, part: int, n_hash_cols: int,
                 vocab_start: int, vocab_end: int, dim: int, block: int, max_tokens: int, device: Any,
                 dequant: Callable[..., None], rank: int = 0) -> None:
        import torch

        if dim + dim // block != ROW_BYTES:
            raise ConfigError(f"Engram row of {dim} values + {dim // block} scales is not {ROW_BYTES} bytes")
        self.source, self.layer_id, self.rank = source, layer_id, rank
        self.head_start, self.part, self.n_hash_cols = head_start, part, n_hash_cols
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.dim, self.block = dim, block
        self.max_tokens = max_tokens
        self.max_rows = max_tokens * part
        self.device = torch.device(device)
        self.dequant = dequant
        # RemoteRowSource fills a caller buffer; other RowSources return their rows
        self._fills = "out" in inspect.signature(source.lookup).parameters
        pin = self.device.type == "cuda"
        nbytes = self.max_rows * (4 + ROW_BYTES)
        self.h_ids = torch.empty((max_tokens, part), dtype=torch.int32, device="cpu", pin_memory=pin)
        self.h_buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.d_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.d_w = torch.empty((self.max_rows, dim), dtype=torch.uint8, device=self.device)
        self.d_s = torch.empty((self.max_rows, dim // block), dtype=torch.uint8, device=self.device)
        self.d_dst = torch.arange(self.max_rows, dtype=torch.int32, device=self.device)
        self._h2d_done = torch.cuda.Event() if pin else None
        self._last_report = time.monotonic()

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes this table's staging holds."""
        return self.h_ids.numel() * 4 + self.h_buf.numel()

    def lookup(self, indices: Any, out: Any) -> None:
        """Fill ``out`` (bf16 ``[T, part, dim]``, vLLM's ``staged_rows[:T]``) for ``indices``
        (int ``[T, n_hash_cols]`` global row ids on ``device``) on the current stream.
        Raises Dsv41Error for T above ``max_tokens``; RowSource errors (``RemoteUnavailable``
        in required mode) propagate."""
        import torch

        t = int(indices.shape[0])
        rows = t * self.part
        if rows == 0:
            return
        if t > self.max_tokens:
            raise Dsv41Error(f"Engram overlay: {t} tokens > staging for {self.max_tokens}")
        if self._h2d_done is not None:
            self._h2d_done.synchronize()  # the previous H2D has left the pinned buffer
        he = min(self.head_start + self.part, self.n_hash_cols)
        width = he - self.head_start
        h_ids = self.h_ids[:t]
        if width > 0:
            h_ids[:, :width].copy_(indices[:, self.head_start:he], non_blocking=self.device.type == "cuda")
        if width < self.part:
            h_ids[:, width:].fill_(-1)  # padded heads: zero rows, as in the kernel
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        buf = self.h_buf.numpy()
        sel = buf[: rows * 4].view(np.int32)
        _, fetch = plan_rows(h_ids.numpy().reshape(-1), self.vocab_start, self.vocab_end, sel_out=sel)
        n = int(fetch.shape[0])
        off = rows * 4
        packed = buf[off: off + n * ROW_BYTES].reshape(n, ROW_BYTES)
        if n:
            if self._fills:
                self.source.lookup(self.layer_id, fetch, out=packed)
            else:
                packed[...] = self.source.lookup(self.layer_id, fetch)
        nb = off + n * ROW_BYTES
        d = self.d_buf[:nb]
        d.copy_(self.h_buf[:nb], non_blocking=True)  # the one H2D copy
        if self._h2d_done is not None:
            self._h2d_done.record()
        d_sel = d[:off].view(torch.int32)
        d_rows = d[off:].view(n, ROW_BYTES)
        if n:
            self.d_w[:n].copy_(d_rows[:, : self.dim])
            self.d_s[:n].copy_(d_rows[:, self.dim:])
        self.dequant(self.d_w, self.d_s, d_sel, self.d_dst, out, n, rows)
        self._maybe_report()

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        report_counters(self.source, self.rank)


def report_counters(source: Any, rank: int) -> dict:
    """Log the row source's counters and write them to ``<tmp>/dsv41-overlay-rank<R>.json``
    (read by the qualification steps: ``docker exec dsv41-serve cat ...``)."""
    c = source.counters()
    log.info("dsv41 overlay rank %d engram counters: %s", rank,
             " ".join(f"{k}={v}" for k, v in sorted(c.items()) if not isinstance(v, float)))
    path = os.path.join(tempfile.gettempdir(), f"dsv41-overlay-rank{rank}.json")
    from dsv41 import fileio
    from dsv41.errors import Dsv41Error

    try:
        fileio.atomic_write_json(path, {"rank": rank, "time": time.time(), "counters": c}, indent=None, default=str)
    except Dsv41Error as exc:  # a full /tmp must not break serving
        log.warning("dsv41 overlay: cannot write %s: %s", path, exc)
    return c


def vllm_dequant(module: ModuleType, emb: Any) -> Callable[..., None]:
    """Launcher of vLLM's own ``_engram_lookup_kernel`` in SORTED mode with BF16 output:
    ``sel`` holds local row ids (``-1`` = zero row), ``dst`` the output row of each entry."""
    import torch

    triton = module.triton
    kernel = module._engram_lookup_kernel

    def run(w: Any, s: Any, sel: Any, dst: Any, out: Any, n: int, rows: int) -> None:
        grid = min(triton.cdiv(rows, 16), emb._num_sms)
        kernel[(grid,)](
            w.view(torch.float8_e4m3fn), s, sel, dst, out, 0, n, rows, 0, 0,
            HEAD_START=emb.head_start, LOCAL_HEADS=emb.part_n_hash_cols, TOTAL_HEADS=emb.n_hash_cols,
            DIM=emb.dim, QUANT_BLOCK=emb.block_size, BLOCK_R=16, GRID=grid, SORTED=True, PACKED=False,
            OUT_STRIDE=out.stride(0), PEER_ROWS=0)

    return run


def check_compilation(vllm_config: Any) -> None:
    """OverlayRefused unless decode runs eager or in breakable PIECEWISE graphs and the
    specialized decode is off (``vllm_contract.json`` ``compilation``)."""
    comp = vllm_config.compilation_config
    mode = getattr(comp.cudagraph_mode, "name", str(comp.cudagraph_mode))
    if mode not in C.COMPILATION["engram_remote"]["cudagraph_mode_allowed"]:
        raise OverlayRefused(
            f"DSV41_ENGRAM_REMOTE needs PIECEWISE (or no) CUDA graphs, vLLM runs cudagraph_mode={mode}: "
            f"a FULL decode graph captures the host-side row fetch once; start vLLM with {C.PIECEWISE_FLAG}")
    if mode == "PIECEWISE":
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        if not is_breakable_cudagraph_enabled():
            raise OverlayRefused(
                "DSV41_ENGRAM_REMOTE needs breakable PIECEWISE graphs (the fetch runs between graph "
                "segments): remove VLLM_USE_BREAKABLE_CUDAGRAPH=0 from the environment")
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict) and extra.get("decode_backend") == "latency_specialized":
        raise OverlayRefused(
            "DSV41_ENGRAM_REMOTE cannot run under the specialized decode (FULL-graph decode steps): "
            "remove \"decode_backend\": \"latency_specialized\" from --additional-config")


def _source(settings: S.OverlaySettings, tp: int, rank: int) -> tuple[Any, Any]:
    """(RowSource, dsv41 EngramLayout) of this rank, one per process (shared by the layers):
    a ``RemoteRowSource`` with ``DSV41_ENGRAM_REMOTE_TIMEOUT_MS`` per request, the engine's
    whole-call deadline ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS`` and busy-poll budget
    ``DSV41_TRANSPORT_CLIENT_SPIN_US``, and the runtime root's tables as its exact fallback."""
    key = (settings.engram_urls, tp, rank)
    with _sources_lock:
        if key in _sources:
            return _sources[key]
        from dsv41.engram.client import RemoteRowSource
        from dsv41.engram.manifest import load_manifest
        from dsv41.engram.sweep import layout_from_manifest
        from dsv41.engram.reader import LocalRowReader

        url = S.rank_url(settings, tp, rank)
        manifest_path, tables_dir = S.runtime_files(settings)
        manifest = load_manifest(manifest_path)
        layout = layout_from_manifest(manifest)
        local = LocalRowReader(manifest, tables_dir) if tables_dir is not None else None
        if local is None:
            log.warning("dsv41 overlay rank %d: no local tables under the runtime root: no exact fallback", rank)
        # the engine's whole-call deadline and busy-poll budget, from the same settings
        # (DSV41_ENGRAM_LOOKUP_DEADLINE_MS, DSV41_TRANSPORT_CLIENT_SPIN_US)
        src = RemoteRowSource(url, manifest, rank, tp, settings.timeout_ms, settings.required, local=local,
                              deadline_ms=settings.env.engram_lookup_deadline_ms,
                              spin_us=settings.env.transport_client_spin_us)
        _sources[key] = (src, layout)
        return _sources[key]


def _skip_weight(param: Any, loaded_weight: Any) -> None:
    """Weight loader of the overlay's zero-row tables: the checkpoint tensor is dropped."""
    return None


def apply(module: ModuleType, settings: S.OverlaySettings, contract: dict) -> None:
    """Patch vLLM's Engram module (``vllm.models.deepseek_v41.common.engram``)."""
    import torch

    if getattr(module, "_dsv41_overlay", False):
        return
    PEE, Engram = module.ParallelEngramEmbedding, module.Engram
    orig_alloc, orig_lookup, orig_create = PEE._allocate_weights, PEE.lookup, Engram._create_embedding

    def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
        token = _layer.set((layout, layer_hash_index))
        try:
            return orig_create(self, layout, layer_hash_index)
        finally:
            _layer.reset(token)

    def _decline(why: str) -> None:
        if settings.required:
            raise OverlayRefused(f"dsv41 overlay: {why}; refusing to start because DSV41_ENGRAM_REMOTE_REQUIRED=1")
        log.error("dsv41 overlay: %s; this table stays on vLLM's own path", why)

    def _allocate_weights(self: Any) -> Any:
        ctx = _layer.get()
        if ctx is None or torch.get_default_device().type == "meta":
            return orig_alloc(self)
        vlayout, hash_index = ctx
        layer_id = int(vlayout.layer_ids[hash_index])
        vcfg = module.get_current_vllm_config()
        check_compilation(vcfg)
        if not self.cpu_offload or self.dp_size != 1 or self.dp_shared_memory or self.peer_rows:
            _decline(f"layer {layer_id}: Engram tables must be host-offloaded, per rank, without Engram DP "
                     f"(cpu_offload={self.cpu_offload}, engram dp_size={self.dp_size}, "
                     f"dp_shared_memory={self.dp_shared_memory})")
            return orig_alloc(self)
        tp, rank = self.tp_size, module.get_tensor_model_parallel_rank()
        src, layout = _source(settings, tp, rank)
        got = {"head_start": self.head_start, "part_n_hash_cols": self.part_n_hash_cols,
               "vocab_start_idx": self.vocab_start_idx, "vocab_end_idx": self.vocab_end_idx}
        problems = C.check_ranges(layout, layer_id, tp, rank, got, contract)
        if int(vlayout.num_embeddings[hash_index]) != layout.rows[layout.layer_index(layer_id)]:
            problems.append(f"layer {layer_id}: vLLM table has {vlayout.num_embeddings[hash_index]} rows, "
                            f"the manifest {layout.rows[layout.layer_index(layer_id)]}")
        if problems:
            _decline("; ".join(problems))
            return orig_alloc(self)
        max_tokens = int(vcfg.scheduler_config.max_num_batched_tokens)
        # vLLM builds the model on the current CUDA device; the CPU is for tests without a GPU
        device = (torch.device("cuda", torch.accelerator.current_device_index()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        self._dsv41 = RemoteRows(
            src, layer_id, head_start=self.head_start, part=self.part_n_hash_cols, n_hash_cols=self.n_hash_cols,
            vocab_start=self.vocab_start_idx, vocab_end=self.vocab_end_idx, dim=self.dim, block=self.block_size,
            max_tokens=max_tokens, device=device, dequant=vllm_dequant(module, self), rank=rank)
        self._weight_loader = _skip_weight  # set_weight_attrs reads it right after this returns
        log.info("dsv41 overlay rank %d layer %d: rows [%d, %d) from %s (fallback: %s); no vLLM host table "
                 "(%.2f GiB not pinned), %.1f MiB pinned staging", rank, layer_id, self.vocab_start_idx,
                 self.vocab_end_idx, src.url, "local shards" if src.local is not None else "none",
                 self.part_num_embeddings * ROW_BYTES / 2**30, self._dsv41.host_bytes / 2**20)
        scale_dim = self.dim // self.block_size
        return (torch.empty(0, self.dim, dtype=torch.float8_e4m3fn, device="cpu"),
                torch.empty(0, scale_dim, dtype=torch.uint8, device="cpu"))

    def lookup(self: Any, indices: Any, out: Any, background: bool = False) -> None:
        rows = getattr(self, "_dsv41", None)
        if rows is None:
            return orig_lookup(self, indices, out, background)
        if out.dtype != torch.bfloat16:
            raise OverlayRefused("dsv41 overlay: packed Engram lookups (Engram DP batches) are not supported")
        rows.lookup(indices, out)

    PEE._allocate_weights = _allocate_weights
    PEE.lookup = lookup
    Engram._create_embedding = _create_embedding
    module._dsv41_overlay = True
