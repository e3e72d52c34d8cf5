"""Engram table layout: primes, offsets, multipliers, rows and per-rank ranges.

Source: engram-spec.md sections 2, 3 and 6, which follow the reference ``inference/engram.py``
of DeepSeek-V4.1-Flash and vLLM's ``ParallelEngramEmbedding`` column split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsv41.engram.config import SCALE_BLOCK, load_model_config
from dsv41.errors import ConfigError, VerificationError

#: Multipliers published for the released layers (engram-spec.md section 3), valid for
#: ``engram_compressed_vocab_size`` 99092 and ``engram_max_ngram_size`` 4.
RELEASED_MULTIPLIERS: dict[int, tuple[int, int, int, int]] = {
    1: (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    14: (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}
RELEASED_COMPRESSED_VOCAB = 99092
RELEASED_MAX_NGRAM = 4
#: Largest tensor-parallel size accepted (``layout --tp`` prints one entry per rank).
MAX_TP = 1024


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases 2..41 are exact below that bound)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def compute_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """Draw one layer's odd int64 multipliers (one per look-back shift 0..max_ngram_size-1).

    Rule (found to reproduce the published values of layers 1 and 14 exactly; checked in
    tests/unit/test_engram_layout.py): ``g = numpy.random.default_rng(10007*layer)`` (PCG64),
    ``bound = (int64_max // compressed_vocab_size) // 2``,
    ``m = g.integers(0, bound, size=max_ngram_size, dtype=int64) * 2 + 1``.  The bound keeps
    ``id * m`` within int64 for any compressed id.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    g = np.random.default_rng(10007 * layer_id)
    r = g.integers(0, bound, size=max_ngram_size, dtype=np.int64)
    return [int(x) for x in r * 2 + 1]


@dataclass
class EngramLayout:
    """Primes, offsets, multipliers and rows of every Engram table of one model.

    Attributes (``li`` indexes ``layer_ids``): ``primes[li][c]`` bucket count of column ``c``
    (``c = (order-2)*n_heads + head``); ``offsets[li][c]`` sum of that layer's primes before
    ``c``; ``multipliers[li][s]`` odd int64 per look-back shift ``s``; ``rows[li]`` table rows
    (sum of the layer's primes); ``row_bytes`` = head_dim FP8 bytes + head_dim/32 scale bytes.
    """

    layer_ids: list[int]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_sizes: list[int]
    compressed_vocab_size: int
    pad_token_id: int
    primes: list[list[int]]
    offsets: list[list[int]]
    multipliers: list[list[int]]
    rows: list[int]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def n_columns(self) -> int:
        """Columns per layer: (max_ngram_size-1) orders x n_heads (24 for V4.1-Flash)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def weight_bytes(self) -> int:
        """FP8 E4M3 bytes per row (head_dim)."""
        return self.head_dim

    @property
    def scale_bytes(self) -> int:
        """UE8M0 scale bytes per row (one per 32 values)."""
        return self.head_dim // SCALE_BLOCK

    @property
    def row_bytes(self) -> int:
        """Packed row size in bytes (264 for head_dim 256)."""
        return self.weight_bytes + self.scale_bytes

    def layer_index(self, layer_id: int) -> int:
        """Index ``li`` of ``layer_id``; ConfigError when the layer has no Engram table."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ConfigError(f"layer {layer_id} has no Engram table (layers: {self.layer_ids})") from None

    @classmethod
    def from_config(cls, cfg: str | Mapping[str, Any]) -> EngramLayout:
        """Build the layout from a config path or mapping (see :func:`load_model_config`).

        Primes: the first primes above ``vocab_size - 1`` of each order, assigned in
        (layer, order, head) order with one ``seen`` set so none repeats across layers.
        Raises ConfigError when ``engram_num_embeddings`` is given and differs from the sums.
        """
        c = load_model_config(cfg)
        layer_ids = list(c["engram_layer_ids"])
        n_max = c["engram_max_ngram_size"]
        n_heads = c["engram_n_heads"]
        vsizes = c["engram_vocab_sizes"]
        cvs = c["engram_compressed_vocab_size"]
        seen: set[int] = set()
        primes, offsets, mults, rows = [], [], [], []
        for layer in layer_ids:
            lp: list[int] = []
            for order in range(2, n_max + 1):
                cand = vsizes[order - 2] - 1
                for _ in range(n_heads):
                    cand += 1
                    while not is_prime(cand) or cand in seen:
                        cand += 1
                    seen.add(cand)
                    lp.append(cand)
            primes.append(lp)
            offsets.append([sum(lp[:i]) for i in range(len(lp))])
            rows.append(sum(lp))
            if layer in RELEASED_MULTIPLIERS and cvs == RELEASED_COMPRESSED_VOCAB and n_max == RELEASED_MAX_NGRAM:
                mults.append(list(RELEASED_MULTIPLIERS[layer]))
            else:
                mults.append(compute_multipliers(layer, n_max, cvs))
        ne = c.get("engram_num_embeddings")
        if ne is not None:
            for layer, got, want in zip(layer_ids, rows, ne, strict=False):
                if got != want:
                    raise ConfigError(
                        f"layer {layer}: engram_num_embeddings says {want} rows but the primes sum to {got}"
                    )
        params = {
            "layer_ids": layer_ids,
            "max_ngram_size": n_max,
            "n_heads": n_heads,
            "head_dim": c["engram_head_dim"],
            "vocab_sizes": vsizes,
            "compressed_vocab_size": cvs,
            "pad_token_id": c["engram_pad_token_id"],
        }
        return cls(
            layer_ids=layer_ids,
            max_ngram_size=n_max,
            n_heads=n_heads,
            head_dim=c["engram_head_dim"],
            vocab_sizes=vsizes,
            compressed_vocab_size=cvs,
            pad_token_id=c["engram_pad_token_id"],
            primes=primes,
            offsets=offsets,
            multipliers=mults,
            rows=rows,
            params=params,
        )

    def columns_for_rank(self, tp: int, rank: int) -> tuple[int, int]:
        """Columns ``[c0, c1)`` rank ``rank`` owns at TP ``tp`` (vLLM convention).

        ``part = ceil(n_columns / tp)``; ``c0 = min(rank*part, n)``, ``c1 = min(c0+part, n)``
        (an empty range when tp does not divide evenly and the rank is past the end).
        ConfigError unless ``1 <= tp <= MAX_TP`` and ``0 <= rank < tp``.
        """
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
            raise ConfigError(f"tp must be an int in [1, {MAX_TP}], got {tp!r}")
        if not isinstance(rank, int) or not 0 <= rank < tp:
            raise ConfigError(f"rank must be in [0, {tp}), got {rank!r}")
        n = self.n_columns
        part = math.ceil(n / tp)
        c0 = min(rank * part, n)
        return c0, min(c0 + part, n)

    def row_range(self, li: int, tp: int, rank: int) -> tuple[int, int]:
        """Global rows ``[lo, hi)`` of table ``li`` owned by ``rank`` (sum of primes before c0/c1)."""
        if not 0 <= li < len(self.layer_ids):
            raise ConfigError(f"layer index {li} out of range [0, {len(self.layer_ids)})")
        c0, c1 = self.columns_for_rank(tp, rank)
        p = self.primes[li]
        return sum(p[:c0]), sum(p[:c1])

    def to_json(self, tp: int = 1) -> dict:
        """The JSON ``dsv41 engram layout CONFIG --tp N`` prints; ConfigError for tp < 1."""
        self.columns_for_rank(tp, 0)  # validates tp
        layers = []
        for li, layer in enumerate(self.layer_ids):
            ranks = []
            for r in range(tp):
                c0, c1 = self.columns_for_rank(tp, r)
                lo, hi = self.row_range(li, tp, r)
                ranks.append({"rank": r, "columns": [c0, c1], "rows": [lo, hi]})
            layers.append(
                {
                    "layer_id": layer,
                    "rows": self.rows[li],
                    "primes": self.primes[li],
                    "offsets": self.offsets[li],
                    "multipliers": self.multipliers[li],
                    "ranks": ranks,
                }
            )
        return {
            "tp": tp,
            "row_bytes": self.row_bytes,
            "weight_bytes": self.weight_bytes,
            "scale_bytes": self.scale_bytes,
            "n_columns": self.n_columns,
            "params": self.params,
            "layers": layers,
        }


def layout_from_manifest(manifest: Any) -> EngramLayout:
    """The :class:`EngramLayout` a manifest was written for.

    ``manifest``: a :class:`dsv41.engram.manifest.Manifest` (its ``layout`` parameters and each
    table's ``hash`` block: ``primes``, ``offsets``, ``multipliers``). Raises ConfigError when the
    layout parameters are not a valid Engram configuration, VerificationError when a table's
    primes, offsets or multipliers disagree with the layout those parameters give (a manifest
    whose tables were hashed for another layout, engram-spec.md section 3).
    """
    p = manifest.layout
    layout = EngramLayout.from_config(
        {
            "engram_layer_ids": p["layer_ids"],
            "engram_max_ngram_size": p["max_ngram_size"],
            "engram_n_heads": p["n_heads"],
            "engram_head_dim": p["head_dim"],
            "engram_vocab_size": p["vocab_sizes"][0],
            "engram_vocab_sizes": p["vocab_sizes"],
            "engram_compressed_vocab_size": p["compressed_vocab_size"],
            "engram_pad_token_id": p["pad_token_id"],
        }
    )
    for li, layer in enumerate(layout.layer_ids):
        h = manifest.table(layer).hash
        if (list(h["primes"]), list(h["offsets"]), list(h["multipliers"])) != (
            list(layout.primes[li]),
            list(layout.offsets[li]),
            list(layout.multipliers[li]),
        ):
            raise VerificationError(f"manifest table of layer {layer}: hash parameters differ from its layout")
    return layout
