"""Remote Engram rows inside vLLM's ``ParallelEngramEmbedding`` (vLLM 0.33.0, see
``vllm_contract.json``).

What changes in vLLM when the overlay is active (``DSV41_ENGRAM_REMOTE`` set):

* ``ParallelEngramEmbedding._allocate_weights`` returns zero-row tensors and the parameters get
  a weight loader that drops the checkpoint's table tensors: no pinned host table is allocated
  or loaded (vLLM 0.33.0 would pin about 94 GiB per rank at TP2).
* ``ParallelEngramEmbedding.lookup(indices, out)`` (called by ``Engram._start_prefetch``, an
  ``eager_break_during_capture`` function, so it re-runs at every PIECEWISE replay) becomes
  ``RemoteRows.start``: the rank's ids ``indices[:, head_start:head_start+part]`` go to a
  pinned host buffer by an async copy on the prefetch stream plus an event, and the job goes to
  the rank's ``EngramWorker`` thread; the launching thread returns without any host wait. The
  worker waits on that event, masks exactly as vLLM's kernel masks (ids outside
  ``[vocab_start_idx, vocab_end_idx)``, ``-1`` and padded heads give zero rows), fetches the
  others through the RowSource (both Engram layers of a decode step in one ``lookup_layers``
  request; remote, exact local fallback, required mode) into pinned memory, copies selectors +
  packed 264-byte rows to the GPU in one H2D copy and launches vLLM's own
  ``_engram_lookup_kernel`` (SORTED mode, BF16 output) into ``staged_rows`` on the prefetch
  stream (one CUDA-graph replay per token count after its first step: ``LaunchGraphs``), records
  the layer's done event and hands the layer off. Values are bit-identical to
  vLLM's local path because the arithmetic is vLLM's own kernel on the same bytes.
* ``Engram._finish_prefetch`` (also an eager break) first waits on the host for that layer's
  hand-off only (``RemoteRows.join``: bounded; a dead or hung worker is a counted refusal;
  required mode raises the cause here), makes the current stream wait on the done event, then
  runs vLLM's own body. A prefill chunk's layer whose piece graphs exist is instead queued whole
  on the GPU at ``_start_prefetch`` and joined there without a host wait (``DSV41_ENGRAM_GPU_JOIN``,
  default 1; never in required mode; ``engram_gpujoin``). Inside a CUDA-graph
  capture (vLLM's breakable capture included) the
  lookup runs synchronously on the launching thread: no second thread calls CUDA then.
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
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dsv41.overlay import contract as C, engram_ops, metrics as overlay_metrics, settings as S
from dsv41.overlay.engram_ops import ROW_BYTES, OverlayRefused, log, plan_rows, report_counters
from dsv41.overlay.engram_rows import RemoteRows
from dsv41.overlay.engram_worker import EngramWorker, stop_workers

__all__ = [
    "ROW_BYTES",
    "EngramWorker",
    "OverlayRefused",
    "RemoteRows",
    "apply",
    "check_compilation",
    "plan_rows",
    "report_counters",
    "stop_workers",
    "vllm_dequant",
]

_layer: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("dsv41_engram_layer", default=None)
_sources: dict[tuple, Any] = {}
_sources_lock = threading.Lock()


def vllm_dequant(module: ModuleType, emb: Any) -> Callable[..., None]:
    """Launcher of vLLM's own ``_engram_lookup_kernel`` in SORTED mode with BF16 output:
    ``sel`` holds local row ids (``-1`` = zero row), ``dst`` the output row of each entry."""
    import torch

    triton = module.triton
    kernel = module._engram_lookup_kernel

    def run(w: Any, s: Any, sel: Any, dst: Any, out: Any, n: int, rows: int) -> None:
        grid = min(triton.cdiv(rows, 16), emb._num_sms)
        kernel[(grid,)](
            w.view(torch.float8_e4m3fn),
            s,
            sel,
            dst,
            out,
            0,
            n,
            rows,
            0,
            0,
            HEAD_START=emb.head_start,
            LOCAL_HEADS=emb.part_n_hash_cols,
            TOTAL_HEADS=emb.n_hash_cols,
            DIM=emb.dim,
            QUANT_BLOCK=emb.block_size,
            BLOCK_R=16,
            GRID=grid,
            SORTED=True,
            PACKED=False,
            OUT_STRIDE=out.stride(0),
            PEER_ROWS=0,
        )

    return run


def check_compilation(vllm_config: Any) -> None:
    """OverlayRefused unless decode runs eager or in breakable PIECEWISE graphs and the
    specialized decode is off (``vllm_contract.json`` ``compilation``)."""
    comp = vllm_config.compilation_config
    mode = getattr(comp.cudagraph_mode, "name", str(comp.cudagraph_mode))
    if mode not in C.COMPILATION["engram_remote"]["cudagraph_mode_allowed"]:
        raise OverlayRefused(
            f"DSV41_ENGRAM_REMOTE needs PIECEWISE (or no) CUDA graphs, vLLM runs cudagraph_mode={mode}: "
            f"a FULL decode graph captures the host-side row fetch once; start vLLM with {C.PIECEWISE_FLAG}"
        )
    if mode == "PIECEWISE":
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        if not is_breakable_cudagraph_enabled():
            raise OverlayRefused(
                "DSV41_ENGRAM_REMOTE needs breakable PIECEWISE graphs (the fetch runs between graph "
                "segments): remove VLLM_USE_BREAKABLE_CUDAGRAPH=0 from the environment"
            )
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict) and extra.get("decode_backend") == "latency_specialized":
        raise OverlayRefused(
            "DSV41_ENGRAM_REMOTE cannot run under the specialized decode (FULL-graph decode steps): "
            'remove "decode_backend": "latency_specialized" from --additional-config'
        )


def _source(settings: S.OverlaySettings, tp: int, rank: int) -> tuple[Any, Any]:
    """(RowSource, dsv41 EngramLayout) of this rank, one per process (shared by the layers):
    a ``RemoteRowSource`` with ``DSV41_ENGRAM_REMOTE_TIMEOUT_MS`` per request, the engine's
    whole-call deadline ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS`` and busy-poll budget
    ``DSV41_TRANSPORT_CLIENT_SPIN_US``, and the runtime root's tables as its exact fallback,
    verified against the manifest first (``LocalRowReader.verify``: VerificationError)."""
    key = (settings.engram_urls, tp, rank)
    with _sources_lock:
        if key in _sources:
            return _sources[key]
        from dsv41.engram.client import RemoteRowSource
        from dsv41.engram.layout import layout_from_manifest
        from dsv41.engram.manifest import load_manifest
        from dsv41.engram.reader import LocalRowReader

        url = S.rank_url(settings, tp, rank)
        manifest_path, tables_dir = S.runtime_files(settings)
        manifest = load_manifest(manifest_path)
        layout = layout_from_manifest(manifest)
        local = LocalRowReader(manifest, tables_dir) if tables_dir is not None else None
        if local is not None:
            # before this worker serves a row: a missing, truncated or changed shard stops it here
            # with the reason (VerificationError), and every later local read checks the shard
            # is still the verified file (docs/operations.md, "Local Engram shards")
            local.verify()
        if local is None:
            log.warning("dsv41 overlay rank %d: no local tables under the runtime root: no exact fallback", rank)
        # the engine's whole-call deadline and busy-poll budget, from the same settings
        # (DSV41_ENGRAM_LOOKUP_DEADLINE_MS, DSV41_TRANSPORT_CLIENT_SPIN_US)
        src = RemoteRowSource(
            url,
            manifest,
            rank,
            tp,
            settings.timeout_ms,
            settings.required,
            local=local,
            deadline_ms=settings.env.engram_lookup_deadline_ms,
            spin_us=settings.env.transport_client_spin_us,
        )
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
    orig_finish = getattr(Engram, "_finish_prefetch", None)
    orig_finish = getattr(orig_finish, "__wrapped__", orig_finish)  # vLLM's body, without its eager break
    try:  # vLLM's breakable capture: its eager breaks run between capture segments
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

        engram_ops._capture_active = BreakableCUDAGraphCapture.is_active
    except (ImportError, AttributeError):  # no vLLM here (tests), or a stand-in without it
        engram_ops._capture_active = None

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
        overlay_metrics.set_state("refused", why=why)  # the checks fail this rank: rows are not remote

    def _allocate_weights(self: Any) -> Any:
        ctx = _layer.get()
        if ctx is None or torch.get_default_device().type == "meta":
            return orig_alloc(self)
        vlayout, hash_index = ctx
        layer_id = int(vlayout.layer_ids[hash_index])
        vcfg = module.get_current_vllm_config()
        check_compilation(vcfg)
        if not self.cpu_offload or self.dp_size != 1 or self.dp_shared_memory or self.peer_rows:
            _decline(
                f"layer {layer_id}: Engram tables must be host-offloaded, per rank, without Engram DP "
                f"(cpu_offload={self.cpu_offload}, engram dp_size={self.dp_size}, "
                f"dp_shared_memory={self.dp_shared_memory})"
            )
            return orig_alloc(self)
        tp, rank = self.tp_size, module.get_tensor_model_parallel_rank()
        src, layout = _source(settings, tp, rank)
        got = {
            "head_start": self.head_start,
            "part_n_hash_cols": self.part_n_hash_cols,
            "vocab_start_idx": self.vocab_start_idx,
            "vocab_end_idx": self.vocab_end_idx,
        }
        problems = C.check_ranges(layout, layer_id, tp, rank, got, contract)
        if int(vlayout.num_embeddings[hash_index]) != layout.rows[layout.layer_index(layer_id)]:
            problems.append(
                f"layer {layer_id}: vLLM table has {vlayout.num_embeddings[hash_index]} rows, "
                f"the manifest {layout.rows[layout.layer_index(layer_id)]}"
            )
        if problems:
            _decline("; ".join(problems))
            return orig_alloc(self)
        max_tokens = int(vcfg.scheduler_config.max_num_batched_tokens)
        # vLLM builds the model on the current CUDA device; the CPU is for tests without a GPU
        device = (
            torch.device("cuda", torch.accelerator.current_device_index())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._dsv41 = RemoteRows(
            src,
            layer_id,
            head_start=self.head_start,
            part=self.part_n_hash_cols,
            n_hash_cols=self.n_hash_cols,
            vocab_start=self.vocab_start_idx,
            vocab_end=self.vocab_end_idx,
            dim=self.dim,
            block=self.block_size,
            max_tokens=max_tokens,
            device=device,
            dequant=vllm_dequant(module, self),
            rank=rank,
            gpu_join=settings.gpu_join,
            local_reader=settings.local_reader,
        )
        self._weight_loader = _skip_weight  # set_weight_attrs reads it right after this returns
        overlay_metrics.add_engram_source(rank, src)
        overlay_metrics.add_layer(rank, layer_id, self._dsv41)
        log.info(
            "dsv41 overlay rank %d layer %d: rows [%d, %d) from %s (fallback: %s); no vLLM host table "
            "(%.2f GiB not pinned), %.1f MiB pinned staging",
            rank,
            layer_id,
            self.vocab_start_idx,
            self.vocab_end_idx,
            src.url,
            "local shards" if src.local is not None else "none",
            self.part_num_embeddings * ROW_BYTES / 2**30,
            self._dsv41.host_bytes / 2**20,
        )
        scale_dim = self.dim // self.block_size
        return (
            torch.empty(0, self.dim, dtype=torch.float8_e4m3fn, device="cpu"),
            torch.empty(0, scale_dim, dtype=torch.uint8, device="cpu"),
        )

    def lookup(self: Any, indices: Any, out: Any, background: bool = False) -> None:
        rows = getattr(self, "_dsv41", None)
        if rows is None:
            return orig_lookup(self, indices, out, background)
        if out.dtype != torch.bfloat16:
            raise OverlayRefused("dsv41 overlay: packed Engram lookups (Engram DP batches) are not supported")
        rows.start(indices, out)  # the worker fetches; _finish_prefetch joins

    def _finish_prefetch(self: Any, event: Any) -> None:
        rows = getattr(self.embed_tokens, "_dsv41", None)
        # the host waits for this layer's hand-off only; the C++ wait then queues the current
        # stream's waits on the rows and on vLLM's ``event`` (its own body: current_stream()
        # .wait_event(event)), where it could not, vLLM's function does it (never waiting for the GIL)
        if rows is not None and rows.join(event) and orig_finish is not None:
            return
        if orig_finish is not None:
            orig_finish(self, event)

    PEE._allocate_weights = _allocate_weights
    PEE.lookup = lookup
    Engram._create_embedding = _create_embedding
    if orig_finish is not None:
        # an eager break like vLLM's own: the hand-off wait re-runs at every PIECEWISE replay
        brk = getattr(module, "eager_break_during_capture", None)
        Engram._finish_prefetch = brk(_finish_prefetch) if brk is not None else _finish_prefetch
    module._dsv41_overlay = True
