"""Exactness sweep: remote rows vs local rows over hashed token sequences (``dsv41 engram sweep``).

Token sequences: varied text (words, numbers, punctuation, mixed case, whitespace runs and some
raw bytes) through the lab byte tokenizer's token map when the manifest's layout is the lab's
(compressed vocab 229); otherwise token ids drawn with a Zipf-like skew through ``--token-map``
or, without one, an identity map over the compressed vocabulary.  Each document is hashed by
``NgramHasher`` the way the engine does it: one prefill chunk, then decode steps of one token
carrying ``DecodeState``.  Every hashed row of the rank's columns (vLLM column convention) of
both layers is looked up remotely through ``RemoteRowSource`` (decode- and prefill-sized
requests) and compared byte for byte with the local reader's rows.  ``lookups`` counts row ids
(entries) looked up, as in the production sweep (839,040 per rank).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from dsv41.engram.layout import layout_from_manifest
from dsv41.errors import Dsv41Error, VerificationError

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are which not but "
    "engram table row prime column hash rank tensor parallel prefill decode token cache memory "
    "spark offload drafter kernel latency throughput Qualification manifest identity server "
    "DeepSeek V4.1 Flash GB10 RoCE 40Gb/s MTU=9000 x86 EPYC fp8 e4m3 ue8m0 bf16 sigmoid gate "
    "Über naïve café résumé 東京 данные λ"
).split()


def _text(rng: np.random.Generator, n_bytes: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while size < n_bytes:
        k = rng.random()
        if k < 0.75:
            w = _WORDS[rng.integers(len(_WORDS))]
            w = w.upper() if rng.random() < 0.05 else (w.capitalize() if rng.random() < 0.15 else w)
            b = w.encode()
        elif k < 0.85:
            b = str(int(rng.integers(0, 10 ** int(rng.integers(1, 7))))).encode()
        elif k < 0.95:
            b = bytes(rng.choice(list(b".,;:!?()[]{}-\"'/\\\t\n  ")) for _ in range(int(rng.integers(1, 4))))
        else:
            b = rng.integers(0, 256, int(rng.integers(1, 6)), dtype=np.uint8).tobytes()
        parts.append(b + (b" " if rng.random() < 0.8 else b""))
        size += len(parts[-1])
    return b"".join(parts)[:n_bytes]


def token_source(layout: Any, token_map_path: str | None):
    """(token_map int32[V], generator(rng, n) -> int64[n] raw ids, description)."""
    if token_map_path:
        from dsv41.engram.hashing import load_token_map

        tm = load_token_map(token_map_path)

        def gen(rng, n):
            z = rng.zipf(1.3, n) - 1
            return np.minimum(z, len(tm) - 1).astype(np.int64)

        return tm, gen, f"zipf ids through {token_map_path}"
    try:
        from dsv41 import tokenizer as tok
    except ImportError:
        tok = None
    if tok is not None and layout.compressed_vocab_size == tok.COMPRESSED_VOCAB_SIZE:

        def gen(rng, n):
            return np.frombuffer(_text(rng, n), dtype=np.uint8).astype(np.int64) + tok.BYTE_OFFSET

        return tok.TOKEN_MAP, gen, "varied text through the lab byte tokenizer's token map"
    tm = np.arange(layout.compressed_vocab_size, dtype=np.int32)

    def gen(rng, n):
        z = rng.zipf(1.3, n) - 1
        return np.minimum(z, len(tm) - 1).astype(np.int64)

    return tm, gen, "zipf ids through an identity map over the compressed vocabulary"


def run_sweep(
    manifest: Any,
    data_dir: str | Path | None,
    remote: str,
    tp: int,
    rank: int,
    lookups: int = 839040,
    seed: int = 0,
    timeout_ms: int = 1000,
    required: bool = False,
    token_map: str | None = None,
    max_prefill_tokens: int = 1024,
    decode_steps: int = 32,
) -> dict:
    """Run the sweep; returns the JSON-able report (``bad_rows`` must be 0; ``per_layer``:
    ``{"<layer id>": {"lookups", "bad_rows"}}``).

    ``manifest``: Manifest or path; ``data_dir``: local shards (default: the manifest's
    directory); ``remote``: ``tcp://`` / ``nixl://`` URL of this rank's server.  Raises
    ``Dsv41Error`` on bad arguments (incl. a rank that owns no columns at this tp), ``RemoteUnavailable`` when ``required`` and the server fails.
    """
    from dsv41.engram.client import RemoteRowSource, _manifest
    from dsv41.engram.hashing import NgramHasher
    from dsv41.engram.reader import LocalRowReader

    if lookups < 1:
        raise Dsv41Error(f"--lookups must be >= 1, got {lookups}")
    if not isinstance(tp, int) or tp < 1 or not 0 <= rank < tp:
        raise Dsv41Error(f"--rank must be in [0, --tp), got rank {rank} tp {tp}")
    m = _manifest(manifest)
    if data_dir is None:
        if m.path is None:
            raise Dsv41Error("sweep needs --data for a manifest not loaded from a file")
        data_dir = Path(m.path).parent
    layout = layout_from_manifest(m)
    c0, c1 = layout.columns_for_rank(tp, rank)
    if c0 == c1:  # e.g. tp 16: part 2, ranks 12..15 own no column; nothing to compare
        raise Dsv41Error(
            f"rank {rank} owns no Engram columns at tp {tp} (columns per rank: {-(-layout.n_columns // tp)})"
        )
    if not 0 <= seed < (1 << 63):
        raise Dsv41Error(f"seed must be in [0, 2^63), got {seed}")
    tm, gen, desc = token_source(layout, token_map)
    hasher = NgramHasher(layout, tm)
    rng = np.random.default_rng([seed, rank])
    reader = LocalRowReader(m, data_dir)
    # The local reader is both the reference and the fallback (fallbacks are reported).
    src = RemoteRowSource([remote], m, 0, 1, timeout_ms=timeout_ms, required=required, local=reader)
    pending: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {L: [] for L in layout.layer_ids}
    pending_rows = 0
    done = bad = requests = 0
    t0 = time.perf_counter()
    lo_hi = [layout.row_range(li, tp, rank) for li in range(len(layout.layer_ids))]

    per_layer = {str(L): {"lookups": 0, "bad_rows": 0} for L in layout.layer_ids}

    def check() -> int:
        nbad = 0
        for L, items in pending.items():
            if not items:
                continue
            ids = np.concatenate([i for i, _ in items])
            got = np.concatenate([g for _, g in items])
            want = reader.read(L, ids)
            b = int(np.count_nonzero((got != want).any(axis=1)))
            per_layer[str(L)]["lookups"] += int(ids.size)
            per_layer[str(L)]["bad_rows"] += b
            nbad += b
            items.clear()
        return nbad

    try:
        while done < lookups:
            state = None
            prefill = int(rng.integers(1, max_prefill_tokens + 1))
            chunks = [prefill] + [1] * int(rng.integers(0, decode_steps + 1))
            toks = gen(rng, sum(chunks))
            pos = 0
            for n in chunks:
                if done >= lookups:
                    break
                rows, state = hasher.hash(toks[pos : pos + n], state=state)
                pos += n
                for li, L in enumerate(layout.layer_ids):
                    ids = rows[:, li, c0:c1].reshape(-1)
                    ids = ids[: lookups - done]
                    if ids.size == 0:
                        break
                    lo, hi = lo_hi[li]
                    if ids.min() < lo or ids.max() >= hi:
                        raise VerificationError(f"hashed row outside rank {rank}'s range [{lo}, {hi}) of layer {L}")
                    got = src.lookup(L, ids)
                    requests += 1
                    pending[L].append((ids, got))
                    pending_rows += ids.size
                    done += ids.size
                if pending_rows >= 262144:
                    bad += check()
                    pending_rows = 0
        bad += check()
        c = src.counters()
    finally:
        src.close()  # closes the reader too
    return {
        "lookups": done,
        "bad_rows": bad,
        "fallbacks": c["fallbacks"],
        "refusals": c["refusals"],
        "transport_errors": c["transport_errors"],
        "reconnects": c["reconnects"],
        "remote_rows": c["remote_rows"],
        "requests": requests,
        "remote": remote,
        "tp": tp,
        "rank": rank,
        "columns": [c0, c1],
        "layers": layout.layer_ids,
        "per_layer": per_layer,
        "tokens": desc,
        "seconds": round(time.perf_counter() - t0, 3),
    }
