"""The dsv41 drafter as vLLM's speculator (vLLM 0.33.0 V2 model runner, ``method: dspark``).

Installed when ``DSV41_DRAFTER_REMOTE`` is set: ``init_speculator`` (bound in
``vllm.v1.worker.gpu.spec_decode`` and, by name, in ``vllm.v1.worker.gpu.model_runner``) returns
an :class:`OverlaySpeculator` built by :func:`speculator_class` over vLLM's ``BaseSpeculator``.
No draft model is loaded (it is not a ``DraftModelSpeculator``, so the runner skips
``load_model``/``set_attn``) and nothing is captured in CUDA graphs.

Each ``propose`` (once per engine step, every TP rank):

* rank 0 builds one ``DraftInput`` per request that sampled a token this step
  (``num_sampled > 0``; chunked-prefill chunks that sampled nothing get no drafts):
  ``hidden`` = row ``query_start_loc[i+1] - 1 - num_rejected[i]`` of the aux hidden state whose
  layer is the drafter's ``tap_layer`` (vLLM's ``aux_hidden_states[j]``, ``j`` = index of
  ``tap_layer`` in ``dspark_target_layer_ids``; DeepSeek-V4.1 hands the entry stream of that
  layer averaged over the ``hc_mult`` copies, float32 here).  That row is the position whose
  logits produced the newest token: the last scheduled position of a prefill, and in a
  verification step the last accepted position (``num_sampled - 1`` past the query start).
  It is the dsv41 drafter's convention (``hidden_offset`` 1: the tap at position
  ``len(token_ids) - 2``, docs/drafter.md), so the same drafter serves the lab engine and vLLM.
  ``token_ids``: the request's last ``n_ctx`` tokens from the runner's ``all_token_ids`` and
  ``total_len`` (after this step's tokens were appended), left-padded with zeros to the full
  length so ``len(token_ids)`` is the context length; ``depth`` = ``num_speculative_tokens``;
  ``temperature`` 0 (greedy drafts: q is a point mass, which vLLM's rejection sampler without
  draft logits verifies exactly).
* rank 0 asks the dsv41 speculator (``dsv41.drafter.spark``: synchronous or the async proxy);
  any failure, a short or malformed answer = no drafts for that round (fail closed).
* the int64 ``[num_reqs, k]`` drafts (``-1`` = none) are broadcast from TP rank 0 over the TP
  group, so every rank feeds identical drafts into the next step.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import numpy as np

from dsv41.errors import ConfigError

log = logging.getLogger("dsv41.overlay")


def hidden_rows(query_start_loc: np.ndarray, num_rejected: np.ndarray) -> np.ndarray:
    """Row of each request's newest-token position in the step's flattened hidden states:
    ``query_start_loc[1:] - 1 - num_rejected`` (int64 ``[num_reqs]``)."""
    q = np.asarray(query_start_loc, np.int64)
    return q[1:] - 1 - np.asarray(num_rejected, np.int64)[: q.size - 1]


def draft_inputs(
    req_ids: list[str],
    num_sampled: np.ndarray,
    hidden: np.ndarray,
    tails: np.ndarray,
    total_len: np.ndarray,
    depth: int,
) -> tuple[list[int], list[Any]]:
    """The DraftInputs of one step: (batch indices, DraftInput list) for requests with
    ``num_sampled > 0``.  ``hidden`` float32 ``[num_reqs, H]``; ``tails`` int ``[num_reqs, n]``
    (the last n tokens, left-padded); ``total_len`` int ``[num_reqs]``."""
    from dsv41.engine.spec_decode import DraftInput

    live, batch = [], []
    n = tails.shape[1]
    for i, rid in enumerate(req_ids):
        if int(num_sampled[i]) <= 0 or depth <= 0:
            continue
        length = int(total_len[i])
        ids = np.zeros(length, np.int64)  # calloc'd: only the tail is touched
        k = min(n, length)
        if k:
            ids[length - k :] = tails[i, n - k :]
        live.append(i)
        batch.append(
            DraftInput(
                request_id=str(rid),
                token_ids=ids,
                hidden=np.asarray(hidden[i], np.float32),
                depth=depth,
                temperature=0.0,
            )
        )
    return live, batch


def fill_drafts(num_reqs: int, k: int, live: list[int], proposals: Any) -> np.ndarray:
    """int64 ``[num_reqs, k]`` drafts, -1 where none.  ``proposals``: one DraftProposal per
    live request; a wrong count or a malformed proposal gives no drafts at all (fail closed)."""
    out = np.full((num_reqs, k), -1, np.int64)
    if proposals is None or len(proposals) != len(live):
        return out
    try:
        rows = [np.asarray(p.tokens, np.int64).reshape(-1)[:k] for p in proposals]
    except (AttributeError, TypeError, ValueError):
        return out
    for i, toks in zip(live, rows, strict=False):
        out[i, : toks.size] = toks
    return out


def speculator_class(base: type) -> type:
    """Build the OverlaySpeculator class over vLLM's ``BaseSpeculator`` (``base``)."""

    class OverlaySpeculator(base):  # type: ignore[misc, valid-type]
        """vLLM speculator that drafts with the dsv41 drafter (see the module docstring).

        ``tp_group``: object with ``rank_in_group``, ``world_size`` and ``broadcast(t, src)``
        (vLLM's GroupCoordinator); ``make_spec``: builds the dsv41 speculator on rank 0.
        """

        def __init__(self, vllm_config: Any, device: Any, req_states: Any, *, tp_group: Any, make_spec: Any) -> None:
            import torch

            spec_cfg = vllm_config.speculative_config
            self.k = int(spec_cfg.num_speculative_tokens)
            self.device = device
            self.req_states = req_states
            self.tp_group = tp_group
            max_reqs = int(vllm_config.scheduler_config.max_num_seqs)
            self.draft_tokens = torch.full((max_reqs, self.k), -1, dtype=torch.int64, device=device)
            self.draft_logits = None  # greedy drafts: vLLM verifies them without draft logits
            self.draft_token_confidence_probs = torch.zeros((max_reqs, self.k), dtype=torch.float32, device=device)
            self.supports_mm_inputs = False
            self.enable_adaptive_verification = False
            self.pcp_manager = None
            self.spec = None
            self.tap_index: int | None = None
            self.n_ctx = 4
            self.failures = 0
            if tp_group.rank_in_group == 0:
                self.spec, tap_layer, self.n_ctx = make_spec(vllm_config)
                layers = list(getattr(spec_cfg.draft_model_config.hf_config, "dspark_target_layer_ids", None) or [])
                if tap_layer in layers:
                    self.tap_index = layers.index(tap_layer)
                else:
                    log.error(
                        "dsv41 drafter: tap layer %s is not among dspark_target_layer_ids %s: no drafts (fail closed)",
                        tap_layer,
                        layers,
                    )

        def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
            """No draft model: nothing runs on the GPU to capture."""
            return None

        def capture(self) -> None:
            """No draft model: nothing to capture."""
            return None

        def prepare_watermarking(self, sampler: Any, idx_mapping: Any) -> None:
            """Watermarking of drafts is not supported: drafts are unwatermarked proposals."""
            return None

        def _rank0_drafts(
            self, input_batch: Any, aux_hidden_states: Any, num_sampled: Any, num_rejected: Any, k: int
        ) -> np.ndarray:
            import torch

            n = input_batch.num_reqs
            if self.spec is None or self.tap_index is None or not aux_hidden_states:
                return np.full((n, k), -1, np.int64)
            rows = torch.from_numpy(
                hidden_rows(input_batch.query_start_loc_np[: n + 1], num_rejected[:n].cpu().numpy())
            )
            hidden = aux_hidden_states[self.tap_index][rows.to(aux_hidden_states[self.tap_index].device)]
            idx = input_batch.idx_mapping[:n]
            total = self.req_states.total_len.gpu[idx].to(torch.int64)
            cols = total[:, None] - self.n_ctx + torch.arange(self.n_ctx, device=total.device)[None, :]
            tails = self.req_states.all_token_ids.gpu[idx[:, None], cols.clamp(min=0)]
            # one device-to-host transfer point for everything the round needs
            hidden_np = hidden.float().cpu().numpy()
            tails_np = tails.cpu().numpy()
            total_np = total.cpu().numpy()
            sampled_np = num_sampled[:n].cpu().numpy()
            live, batch = draft_inputs(list(input_batch.req_ids[:n]), sampled_np, hidden_np, tails_np, total_np, k)
            if not batch:
                return np.full((n, k), -1, np.int64)
            try:
                props = self.spec.propose(batch)
            except Exception as exc:  # noqa: BLE001 - fail closed: no drafts this round
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:
                    log.warning("dsv41 drafter failed (%d so far), no drafts this round: %s", self.failures, exc)
                props = None
            return fill_drafts(n, k, live, props)

        def propose(
            self,
            input_batch: Any,
            attn_metadata: Any,
            slot_mappings: Any,
            last_hidden_states: Any,
            aux_hidden_states: Any,
            num_sampled: Any,
            num_rejected: Any,
            last_sampled: Any,
            next_prefill_tokens: Any,
            temperature: Any,
            seeds: Any,
            dp_sync_state: Any = None,
            dummy_run: bool = False,
            skip_attn_for_dummy_run: bool = False,
            mm_inputs: Any = None,
            is_profile: bool = False,
            num_speculative_tokens: int | None = None,
        ) -> Any:
            """int64 ``[num_reqs, k]`` drafts (-1 = none), identical on every TP rank."""
            import torch

            n = input_batch.num_reqs
            out = self.draft_tokens[:n]
            out.fill_(-1)
            if dummy_run or is_profile or n == 0:
                return out  # every rank takes this branch alike: no collective skipped on one
            k = self.k if num_speculative_tokens is None else min(self.k, int(num_speculative_tokens))
            if self.tp_group.rank_in_group == 0:
                drafts = np.full((n, self.k), -1, np.int64)
                drafts[:, :k] = self._rank0_drafts(input_batch, aux_hidden_states, num_sampled, num_rejected, k)
                out.copy_(torch.from_numpy(drafts))
            self.tp_group.broadcast(out, src=0)
            return out

        def counters(self) -> dict:
            """The dsv41 speculator's counters (rank 0; empty elsewhere)."""
            c = dict(self.spec.counters()) if self.spec is not None else {}
            c["overlay_failures"] = self.failures
            return c

    return OverlaySpeculator


def make_dsv41_spec(vllm_config: Any, settings: Any) -> tuple[Any, int, int]:
    """Build the dsv41 speculator ``settings`` (:class:`dsv41.envs.Settings`, ``DSV41_DRAFTER_*``)
    ask for; returns (speculator, tap layer, n_ctx).  ConfigError when the drafter files are
    missing or do not fit the target model (hidden or vocab size)."""
    from dsv41.drafter.factory import build_speculator as build
    from dsv41.drafter.model import load_config

    if not settings.drafter_dir:
        raise ConfigError("DSV41_DRAFTER_DIR: DSV41_DRAFTER_REMOTE needs DSV41_DRAFTER_DIR")
    hf = vllm_config.model_config.hf_config
    model_cfg = {"hidden_size": getattr(hf, "hidden_size", None), "vocab_size": getattr(hf, "vocab_size", None)}
    spec = build(settings, model_cfg=model_cfg, target_identity="")
    cfg = load_config(settings.drafter_dir)
    return spec, int(cfg.tap_layer), int(cfg.n_ctx)


def build_speculator(base: type, vllm_config: Any, device: Any, req_states: Any, tp_group: Any, env: Any) -> Any:
    """The OverlaySpeculator over ``base`` whose rank 0 asks the drafter ``env`` configures."""
    from dsv41.overlay import metrics as overlay_metrics

    cls = speculator_class(base)
    spec = cls(vllm_config, device, req_states, tp_group=tp_group, make_spec=lambda cfg: make_dsv41_spec(cfg, env))
    if spec.spec is not None:  # rank 0 drafts; its counters are the dsv41_drafter_* series
        overlay_metrics.add_drafter(spec.counters)
    return spec


def apply_init_speculator(module: ModuleType, settings: Any) -> None:
    """Replace ``init_speculator`` in ``module`` (vLLM's spec_decode package or the model
    runner, which binds it by name): ``method: dspark`` gets the OverlaySpeculator."""
    if getattr(module, "_dsv41_overlay", False) or not hasattr(module, "init_speculator"):
        return
    orig = module.init_speculator
    if getattr(orig, "_dsv41_overlay", False):  # the model runner bound the already patched one
        module._dsv41_overlay = True
        return

    def init_speculator(vllm_config: Any, device: Any, req_states: Any) -> Any:
        if vllm_config.speculative_config.method != "dspark":
            log.error(
                "dsv41 drafter: DSV41_DRAFTER_REMOTE is set but --speculative-config method is %r, "
                "not 'dspark': vLLM's own speculator is used",
                vllm_config.speculative_config.method,
            )
            return orig(vllm_config, device, req_states)
        from vllm.distributed import get_tp_group
        from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

        return build_speculator(BaseSpeculator, vllm_config, device, req_states, get_tp_group(), settings.env)

    init_speculator.__doc__ = orig.__doc__
    init_speculator._dsv41_overlay = True  # type: ignore[attr-defined]
    module.init_speculator = init_speculator
    module._dsv41_overlay = True
