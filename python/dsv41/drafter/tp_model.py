"""The drafter split over two ranks (tensor parallel, TP2): one rank's shard of the weights and
the forward both ranks run in step.

Split (column-parallel throughout; ``[lo, hi)`` is the rank's half of an output dimension, the
first rank taking the larger half when it is odd):

=============  =================================  ==============================================
weight         one card                           rank r holds
=============  =================================  ==============================================
embed          [V, d]                             columns d[lo:hi] (lookups gathered to [., d])
in_proj        [d, H + n_ctx*d]                   rows d[lo:hi]
block.up       [2d, d]                            rows 2d[lo:hi]
block.down     [d, 2d]                            rows d[lo:hi]
lm_head        [V, d]                             rows V[lo:hi]
markov_b       [rank, V]                          columns V[lo:hi]
markov_a       [V, rank]                          all (small; one collective less per step)
norms          [H] / [d]                          all
=============  =================================  ==============================================

Every matrix product computes whole output elements (a full-length dot product) and the ranks
all-gather the output columns; nothing is ever summed across ranks, so no reduction order changes.
What can still differ is the kernel the BLAS library picks for a half-width product (a remainder
loop for an odd width, another blocking for a very wide one). Measured on CPU
(tests/unit/test_drafter_worker_tp.py): with even halves (d_model 32, vocab 40) the drafts, top ids
and probabilities are bit-identical to the one-card worker; with odd ones (d_model 33, vocab 41)
tokens and top ids are identical and probabilities differ by at most 1.5e-7. Both ranks run the
replicated parts (norms, softmax, top-n, the draft choice) on identical inputs with the same
intra-op thread count, which is why the pair checks require two identical cards.

Collectives per round: 2 + 2 per layer to encode, 4 per draft step (logits, the new token's
embedding, the step block's two products).
"""

from __future__ import annotations

import numpy as np

from dsv41.drafter.model import pick_step


def split(n: int, tp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of ``rank``'s part of ``n`` (the first ``n % tp`` ranks take one more)."""
    base, extra = divmod(n, tp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ShardedDrafter:
    """Rank ``comm.rank``'s shard of a drafter and the TP forward (torch imported lazily).

    ``cfg``: :class:`~dsv41.drafter.model.DrafterConfig`; ``state``: the one-card state dict
    (float32 CPU tensors, as ``load_model`` gives); ``comm``: an object with ``rank``, ``tp`` and
    ``gather_cols(t[N, c], what) -> t[N, tp * c]`` (``dsv41.engine.tp.DistComm``; it raises ``PeerLost``
    when the peer dies or does not answer within its timeout); ``device``: ``cpu`` or ``cuda:N``.
    """

    def __init__(self, cfg, state: dict, comm, device: str = "cpu") -> None:
        import torch

        self.torch, self.cfg, self.comm = torch, cfg, comm
        self.device = torch.device(device)
        r, tp = comm.rank, comm.tp
        d, v = cfg.d_model, cfg.vocab_size
        self.d_part = [split(d, tp, i) for i in range(tp)]
        self.d2_part = [split(2 * d, tp, i) for i in range(tp)]
        self.v_part = [split(v, tp, i) for i in range(tp)]
        dlo, dhi = self.d_part[r]
        d2lo, d2hi = self.d2_part[r]
        vlo, vhi = self.v_part[r]
        self.dlo, self.dhi = dlo, dhi

        def put(t):
            return t.detach().to(self.device, dtype=torch.float32).contiguous()

        self.embed = put(state["embed"][:, dlo:dhi])
        self.in_norm = put(state["in_norm"])
        self.in_proj = put(state["in_proj"][dlo:dhi])
        self.blocks = []
        for prefix in [f"layers.{i}." for i in range(cfg.n_layers)] + ["step."]:
            self.blocks.append(
                (
                    put(state[prefix + "norm"]),
                    put(state[prefix + "up"][d2lo:d2hi]),
                    put(state[prefix + "down"][dlo:dhi]),
                )
            )
        self.out_norm = put(state["out_norm"])
        self.lm_head = put(state["lm_head"][vlo:vhi])
        self.markov_a = put(state["markov_a"])
        self.markov_b = put(state["markov_b"][:, vlo:vhi])

    def shard_bytes(self) -> int:
        """Bytes of weights this rank holds."""
        ts = [self.embed, self.in_norm, self.in_proj, self.out_norm, self.lm_head, self.markov_a, self.markov_b]
        ts += [t for blk in self.blocks for t in blk]
        return sum(t.numel() * t.element_size() for t in ts)

    # ------------------------------------------------------------------ pieces

    def _gather(self, local, parts):
        """``local[N, hi-lo]`` on each rank -> ``[N, sum]`` in rank order (uneven halves padded)."""
        torch = self.torch
        width = max(hi - lo for lo, hi in parts)
        if local.shape[1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        whole = self.comm.gather_cols(local.contiguous(), "all_gather(drafter columns)")
        if all(hi - lo == width for lo, hi in parts):
            return whole
        return torch.cat([whole[:, i * width : i * width + (hi - lo)] for i, (lo, hi) in enumerate(parts)], dim=1)

    def _rms(self, x, w):
        torch = self.torch
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * w

    def _embed(self, tok):
        """Rows of the embedding for int64 ids of any shape -> ``[*shape, d]``."""
        flat = self.embed[tok.reshape(-1)]
        return self._gather(flat, self.d_part).reshape(*tok.shape, self.cfg.d_model)

    def _block(self, x, blk):
        norm, up, down = blk
        torch = self.torch
        h = self._rms(x, norm)
        a = self._gather(torch.nn.functional.silu(h @ up.t()), self.d2_part)
        return self._gather(x[:, self.dlo : self.dhi] + a @ down.t(), self.d_part)

    def _logits(self, x, prev):
        part = self._rms(x, self.out_norm) @ self.lm_head.t() + self.markov_a[prev] @ self.markov_b
        return self._gather(part, self.v_part)

    # ------------------------------------------------------------------ the forward

    def draft(self, hidden, ctx, inv_temp, u, k: int):
        """The one-card ``DrafterModel.draft`` over the pair: numpy inputs as
        :func:`dsv41.drafter.model.round_arrays` gives them (``hidden`` float32[B, H], ``ctx``
        int64[B, n_ctx], ``inv_temp`` float32[B], ``u`` float32[B, >=k]); returns numpy tokens
        int64[B, k], top ids int64[B, k, top_n], top probs float32[B, k, top_n] on every rank."""
        torch = self.torch
        dev, top_n = self.device, self.cfg.top_n
        with torch.inference_mode():
            hid = torch.from_numpy(np.ascontiguousarray(hidden)).to(dev)
            c = torch.from_numpy(np.ascontiguousarray(ctx)).to(dev)
            it = torch.from_numpy(np.ascontiguousarray(inv_temp)).to(dev)
            uu = torch.from_numpy(np.ascontiguousarray(u)).to(dev)
            e = self._embed(c).reshape(c.shape[0], -1)
            x = torch.cat([self._rms(hid, self.in_norm), e], dim=-1) @ self.in_proj.t()
            x = self._gather(x, self.d_part)
            for blk in self.blocks[:-1]:
                x = self._block(x, blk)
            prev = c[:, -1]
            toks, ids, probs = [], [], []
            for i in range(k):
                tok, ti, tp = pick_step(self._logits(x, prev) * it[:, None], uu[:, i : i + 1], top_n)
                toks.append(tok)
                ids.append(ti)
                probs.append(tp)
                prev = tok
                x = self._block(x + self._embed(tok), self.blocks[-1])
            return (
                torch.stack(toks, 1).cpu().numpy(),
                torch.stack(ids, 1).cpu().numpy(),
                torch.stack(probs, 1).cpu().numpy(),
            )
