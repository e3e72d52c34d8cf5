"""Distil the drafter from the engine's target (``dsv41 drafter train``).

Method (docs/drafter.md): the target (``dsv41.engine.runner.LocalRunner``, greedy) continues
``n_prompts`` snippets of the engine's own training corpus (``dsv41.engine.corpus``, seeded) by
``gen_tokens`` tokens. Every position ``L`` of the generated part gives one example in the engine's
drafting convention (engine/spec_decode.py): hidden = tap row ``L - 2``, context = tokens ``[:L]``,
targets = the target's next ``max_k`` greedy tokens ``[L : L + max_k]``. The drafter is trained
with teacher forcing (cross-entropy summed over the draft positions, Adam), single-threaded and
seeded, so the same inputs give the same weights (and identities). Acceptance is then measured
offline on the six default greedy-reference prompts (``dsv41.harness.refs.PROMPTS``) by
simulating greedy speculative decoding against the target's own continuation: drafts of depth
``k`` (5) from the true context, accepted while equal to the target's tokens, then advance by
accepted + 1.

Engram rows come from ``--manifest/--data`` when given, otherwise from the synthetic tables
``dsv41 engram make-tables --seed N`` writes (computed in memory, identical bytes).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np

from dsv41 import fileio
from dsv41.drafter.model import DrafterConfig, DrafterModel, identities, save_drafter
from dsv41.engram.rowsource import COUNTER_KEYS, RowSource
from dsv41.errors import ConfigError

log = logging.getLogger("dsv41.drafter.train")

DEFAULTS = {
    "n_prompts": 24,
    "prompt_chars": 48,
    "gen_tokens": 48,
    "steps": 300,
    "lr": 3e-3,
    "batch": 256,
    "d_model": 96,
    "n_layers": 3,
    "n_ctx": 4,
    "markov_rank": 32,
    "max_k": 7,
    "eval_tokens": 32,
    "eval_k": 5,
}


class SyntheticRowSource(RowSource):
    """A ``RowSource`` serving the synthetic Engram tables of ``make-tables --seed`` from memory
    (``dsv41.engram.synthetic.synthetic_rows``, materialised once per layer: 264 B x rows, ~50 MB
    for the lab model), so training needs no table files. ``model_cfg``: the model config dict
    (its ``engram_*`` keys); ``seed``: the tables' seed. Counters: lookups, rows and latency
    (seconds); the failure counters stay 0."""

    def __init__(self, model_cfg: dict, seed: int) -> None:
        from dsv41.engram.layout import EngramLayout

        self.layout = EngramLayout.from_config(model_cfg)
        self.seed = seed
        self._c: dict[str, float | int] = {k: 0 for k in COUNTER_KEYS}
        self._tables: dict[int, np.ndarray] = {}

    def lookup(self, layer_id: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``uint8[N, 264]`` of global ids ``rows`` (int ``[N]``) of ``layer_id``, written
        into ``out`` when given (``RowSource.lookup``). RowRangeError for an unknown layer or
        an id outside the table."""
        from dsv41.engram.shards import RowRangeError, check_row_ids
        from dsv41.engram.synthetic import synthetic_rows

        t0 = time.perf_counter()
        t = self._tables.get(layer_id)
        if t is None:
            if layer_id not in self.layout.layer_ids:
                raise RowRangeError(f"no Engram table for layer {layer_id} (layers: {list(self.layout.layer_ids)})")
            total = int(self.layout.rows[self.layout.layer_index(layer_id)])
            t = self._tables[layer_id] = synthetic_rows(self.seed, layer_id, total, np.arange(total))
        ids = check_row_ids(rows, t.shape[0], layer_id)
        if out is None:
            out = t[ids]
        else:
            np.take(t, ids, axis=0, out=out)
        self._c["lookups"] += 1
        self._c["rows"] += int(ids.size)
        self._c["latency_sum_s"] += time.perf_counter() - t0
        self._c["latency_count"] += 1
        return out

    def counters(self) -> dict:
        """Snapshot of the counters (:data:`dsv41.engram.rowsource.COUNTER_KEYS`, ``source: "synthetic"``)."""
        return {"source": "synthetic", **self._c}

    def close(self) -> None:
        """Drop the materialised tables."""
        self._tables.clear()


def make_row_source(config_path: str, manifest: str | None, data: str | None, tables_seed: int):
    """Local reader over real table files, or the in-memory synthetic tables."""

    if manifest or data:
        if not (manifest and data):
            raise ConfigError("--manifest and --data go together")
        from dsv41.engram.manifest import load_manifest
        from dsv41.engram.reader import LocalRowReader
        from dsv41.engram.rowsource import LocalRowSource

        return LocalRowSource(LocalRowReader(load_manifest(manifest), data))

    try:
        cfg = fileio.loads_json(fileio.read_text(config_path, "model config", error=ConfigError))
    except ValueError as exc:
        raise ConfigError(f"cannot read model config {config_path}: {exc}") from None
    return SyntheticRowSource(cfg, tables_seed)


def _examples(seqs, prompt_lens, taps, n_ctx: int, k: int):
    """Build (hidden float32[N,H], ctx int64[N,n_ctx], targets int64[N,k]) in the engine's
    convention (hidden = tap row L-2 for context length L)."""
    hs, cs, ts = [], [], []
    for s, p, tap in zip(seqs, prompt_lens, taps, strict=False):
        s = np.asarray(s, np.int64)
        for L in range(p + 1, len(s) - k + 1):
            ctx = np.zeros(n_ctx, np.int64)
            tail = s[max(0, L - n_ctx) : L]
            ctx[n_ctx - tail.size :] = tail
            hs.append(tap[L - 2])
            cs.append(ctx)
            ts.append(s[L : L + k])
    return np.stack(hs).astype(np.float32), np.stack(cs), np.stack(ts)


def simulate_acceptance(drafter, seq, prompt_len: int, tap, k: int) -> tuple[int, int, int]:
    """Greedy speculative decoding of ``seq`` (prompt + target greedy continuation) with
    ``drafter`` (a :class:`~dsv41.drafter.model.TorchDrafter`): returns (accepted, drafted, rounds)."""
    from dsv41.drafter.protocol import RoundItem

    seq = np.asarray(seq, np.int64)
    L = prompt_len + 1
    acc = drafted = rounds = 0
    while L < len(seq):
        d = min(k, len(seq) - L)
        dr = drafter.draft([RoundItem("sim", seq[:L], tap[L - 2], d)]).tokens[0]
        a = 0
        while a < d and dr[a] == seq[L + a]:
            a += 1
        acc, drafted, rounds = acc + a, drafted + d, rounds + 1
        L += a + 1
    return acc, drafted, rounds


def train_drafter(
    config: str,
    weights: str,
    out: str,
    *,
    steps: int | None = None,
    seed: int = 0,
    manifest: str | None = None,
    data: str | None = None,
    tables_seed: int = 41,
    runner=None,
    **overrides,
) -> dict:
    """Distil a drafter into ``out``; returns a report (identities, loss, held-out acceptance).

    ``runner``: an already-built ``LocalRunner`` (tests share one). Raises :class:`ConfigError`
    for unreadable inputs.
    """
    import torch

    from dsv41.drafter.model import TorchDrafter
    from dsv41.engine.corpus import corpus_text
    from dsv41.engine.runner import LocalRunner
    from dsv41.engine.weights import target_identity
    from dsv41.harness.refs import PROMPTS
    from dsv41.tokenizer import ByteTokenizer

    hp = dict(DEFAULTS)
    unknown = set(overrides) - set(hp)
    if unknown:
        raise ConfigError(f"drafter train: unknown settings {sorted(unknown)}")
    hp.update(overrides)
    if steps is not None:
        hp["steps"] = int(steps)
    t0 = time.monotonic()
    try:  # fail before minutes of work, not after
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"drafter train: cannot create --out {out}: {exc}") from None
    if runner is None:
        runner = LocalRunner(config, weights, make_row_source(config, manifest, data, tables_seed))
    tid = target_identity(config, weights)
    tok = ByteTokenizer()
    mcfg = runner.cfg
    # training continuations: corpus snippets (seeded), starting at sentence boundaries
    text = corpus_text(10_000 + seed, hp["n_prompts"] * (hp["prompt_chars"] + 200))
    rng = np.random.default_rng(seed)
    starts = [i + 2 for i in range(len(text) - hp["prompt_chars"] - 2) if text[i] == "."]
    picks = rng.choice(len(starts), size=min(hp["n_prompts"], len(starts)), replace=False)
    seqs, plens, taps = [], [], []
    for j in sorted(picks.tolist()):
        ids = tok.encode(text[starts[j] : starts[j] + hp["prompt_chars"]], bos=True)
        res = runner.generate(ids, hp["gen_tokens"])
        seqs.append(ids + res.tokens)
        plens.append(len(ids))
        taps.append(res.hidden_tap)
    t_gen = time.monotonic() - t0
    cfg = DrafterConfig(
        vocab_size=mcfg.vocab_size,
        hidden_size=mcfg.hidden_size,
        d_model=hp["d_model"],
        n_layers=hp["n_layers"],
        n_ctx=hp["n_ctx"],
        markov_rank=hp["markov_rank"],
        max_k=hp["max_k"],
        tap_layer=int(mcfg.drafter_tap_layer),
        seed=seed,
        target_identity=tid,
    )
    cfg.validate()
    hid, ctx, tgt = _examples(seqs, plens, taps, cfg.n_ctx, cfg.max_k)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic regardless of the caller's thread count
    try:
        torch.manual_seed(seed)
        model = DrafterModel(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=hp["lr"])
        g = torch.Generator().manual_seed(seed + 1)
        H, C, T = torch.from_numpy(hid), torch.from_numpy(ctx), torch.from_numpy(tgt)
        n = H.shape[0]
        loss_v = float("nan")
        for step in range(hp["steps"]):
            idx = torch.randint(0, n, (min(hp["batch"], n),), generator=g)
            logits = model(H[idx], C[idx], T[idx])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), T[idx].reshape(-1))
            for grp in opt.param_groups:
                grp["lr"] = hp["lr"] * (0.1 + 0.9 * (1 - step / max(1, hp["steps"])))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_v = float(loss.detach())
    finally:
        torch.set_num_threads(threads)
    cfg.train = {
        "method": "greedy distillation, teacher forcing",
        "steps": hp["steps"],
        "examples": int(n),
        "final_loss": round(loss_v, 4) if math.isfinite(loss_v) else None,
        "seed": seed,
        "settings": hp,
    }
    save_drafter(model, cfg, out)
    # held-out acceptance on the default prompts
    drafter = TorchDrafter(out)
    per_prompt = {}
    tot_a = tot_d = 0
    for name, prompt in PROMPTS:
        ids = tok.encode(prompt, bos=True)
        res = runner.generate(ids, hp["eval_tokens"])
        a, d, r = simulate_acceptance(drafter, ids + res.tokens, len(ids), res.hidden_tap, hp["eval_k"])
        per_prompt[name] = {"accepted": a, "drafted": d, "rounds": r, "accepted_per_round": round(a / max(r, 1), 3)}
        tot_a, tot_d = tot_a + a, tot_d + d
    rep = {
        "identities": identities(out),
        "final_loss": loss_v if math.isfinite(loss_v) else None,  # no step: no loss
        "examples": int(n),
        "generate_s": round(t_gen, 2),
        "seconds": round(time.monotonic() - t0, 2),
        "heldout_acceptance": tot_a / max(tot_d, 1),
        "per_prompt": per_prompt,
    }
    log.info("drafter distilled: loss %.3f, acceptance %.2f", loss_v, rep["heldout_acceptance"])
    return rep
