"""Vectorised Engram n-gram hash (engram-spec.md section 3).

Per position ``p`` and Engram layer: history slot ``s`` (0..max_ngram-1) holds the compressed
id ``c[p-s]``; a slot before the sequence start or a DEAD (masked) token sets a "blocked" flag
that stays set for all older slots, and blocked slots hold the compressed pad id.
``rolling = v0*m0``; for ``s >= 1``: ``rolling ^= v_s*m_s`` (int64 wrap-around), then for each
head ``h``: ``row = rolling mod prime[col] + offset[col]`` with ``col = (s-1)*n_heads + h``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv41 import fileio
from dsv41.engram.layout import EngramLayout
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

#: sha256 of the real 129,280-entry token map as little-endian int32 (engram-spec.md section 3).
REAL_TOKEN_MAP_SHA256 = "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"
REAL_TOKEN_MAP_LEN = 129280

#: Marker for a blocked history slot (sequence start or DEAD token) in :class:`DecodeState`.
BLOCKED = -1


def token_map_sha256(token_map: np.ndarray) -> str:
    """Hex sha256 of a token map encoded as little-endian int32 (the spec's canonical form)."""
    return hashlib.sha256(np.ascontiguousarray(token_map, dtype="<i4").tobytes()).hexdigest()


def check_token_map(token_map: np.ndarray, expected: str = REAL_TOKEN_MAP_SHA256) -> str:
    """Check a token map's sha256 against ``expected``; return the digest.

    Raises VerificationError naming both digests on mismatch.  Use this for the real
    129,280-entry map; synthetic maps (tests, lab) have their own digests.
    """
    got = token_map_sha256(token_map)
    if got != expected:
        raise VerificationError(f"token map sha256 {got} (len {len(token_map)}) differs from the expected {expected}")
    return got


def load_token_map(path: str | os.PathLike) -> np.ndarray:
    """Load a token map: JSON list of ints, JSON object with key ``token_map``, ``.npy``, or raw
    little-endian int32 (``.bin``).  Returns int32[V].  ConfigError on anything else."""

    p = Path(path)
    try:
        if p.suffix == ".npy":
            import io

            arr = np.load(io.BytesIO(fileio.read_bytes(p, "token map", error=ConfigError)))
        elif p.suffix == ".bin":
            raw = fileio.read_bytes(p, "token map", error=ConfigError)
            if len(raw) % 4:
                raise ConfigError(f"token map {p}: size {len(raw)} is not a multiple of 4 (int32)")
            arr = np.frombuffer(raw, dtype="<i4")
        else:
            data = fileio.loads_json(fileio.read_text(p, "token map", error=ConfigError))
            if isinstance(data, dict):
                if "token_map" not in data:
                    raise ConfigError(f"token map {p}: JSON object has no key 'token_map'")
                data = data["token_map"]
            if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
                raise ConfigError(f"token map {p}: expected a JSON list of ints")
            arr = np.asarray(data, dtype=np.int64)
    except FileNotFoundError:
        raise ConfigError(f"token map {p} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"token map {p} is not valid JSON: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read token map {p}: {exc}") from None
    return _validate_token_map(arr, str(p))


def _validate_token_map(arr: np.ndarray, where: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"token map {where}: must be a non-empty 1-D integer array")
    if arr.min() < 0 or arr.max() > np.iinfo(np.int32).max:
        raise ConfigError(f"token map {where}: ids must be in [0, 2^31)")
    return arr.astype(np.int32)


@dataclass
class DecodeState:
    """Hash history of one request: the last ``max_ngram_size-1`` compressed ids, oldest first.

    ``history`` is int64[max_ngram_size-1]; :data:`BLOCKED` (-1) marks a slot before the start
    of the sequence or a DEAD token.  A fresh request starts with every slot blocked.
    """

    history: np.ndarray = field(default_factory=lambda: np.full(3, BLOCKED, dtype=np.int64))

    @classmethod
    def initial(cls, lookback: int = 3) -> DecodeState:
        """State at the start of a sequence (all ``lookback`` slots blocked)."""
        return cls(np.full(lookback, BLOCKED, dtype=np.int64))

    def copy(self) -> DecodeState:
        """Independent copy (for forking a request)."""
        return DecodeState(self.history.copy())


class NgramHasher:
    """Hash raw token ids into global table rows for every Engram layer.

    ``token_map`` int32[V] maps raw ids to compressed ids.  :meth:`hash` returns
    int64[T, n_layers, n_columns] (24 columns for V4.1-Flash) plus the state to pass with the
    next chunk of the same request.
    """

    def __init__(self, layout: EngramLayout, token_map: np.ndarray) -> None:
        self.layout = layout
        self.token_map = _validate_token_map(token_map, "argument").astype(np.int64)
        self.lookback = layout.max_ngram_size - 1
        pad = layout.pad_token_id
        if not 0 <= pad < len(self.token_map):
            raise ConfigError(f"engram_pad_token_id {pad} is outside the token map (len {len(self.token_map)})")
        self.pad_compressed = int(self.token_map[pad])
        cvs = layout.compressed_vocab_size
        if int(self.token_map.max()) >= cvs:
            # ids beyond the compressed vocabulary could overflow the int64 products the
            # multipliers were bounded for (layout.compute_multipliers)
            raise ConfigError(
                f"token map holds compressed id {int(self.token_map.max())}, outside engram_compressed_vocab_size {cvs}"
            )
        self._mult = np.asarray(layout.multipliers, dtype=np.int64)  # [L, N]
        self._primes = np.asarray(layout.primes, dtype=np.int64)  # [L, C]
        self._offsets = np.asarray(layout.offsets, dtype=np.int64)  # [L, C]

    def initial_state(self) -> DecodeState:
        """State of a request that has not hashed any token yet."""
        return DecodeState.initial(self.lookback)

    def hash(
        self,
        tokens: np.ndarray,
        mask: np.ndarray | None = None,
        state: DecodeState | None = None,
    ) -> tuple[np.ndarray, DecodeState]:
        """Hash a chunk of one request.

        ``tokens`` int[T] raw ids; ``mask`` bool[T] (True = live, False = DEAD) or None;
        ``state`` from the previous chunk (None = start of the sequence).  Returns
        (rows int64[T, n_layers, n_columns], new_state).  Raises Dsv41Error for ids outside the
        token map or a mask of the wrong length.
        """
        tok = np.asarray(tokens)
        if tok.ndim != 1 or (tok.size and not np.issubdtype(tok.dtype, np.integer)):
            raise Dsv41Error("tokens must be a 1-D integer array")
        tok = tok.astype(np.int64, copy=False)
        T = tok.shape[0]
        if T and (tok.min() < 0 or tok.max() >= len(self.token_map)):
            bad = int(tok[(tok < 0) | (tok >= len(self.token_map))][0])
            raise Dsv41Error(f"token id {bad} is outside the token map [0, {len(self.token_map)})")
        if state is None:
            state = self.initial_state()
        if state.history.shape != (self.lookback,):
            raise Dsv41Error(f"decode state must hold {self.lookback} ids, got {state.history.shape}")
        comp = self.token_map[tok]
        if mask is not None:
            m = np.asarray(mask)
            if m.shape != (T,):
                raise Dsv41Error(f"mask has shape {m.shape}, tokens have {T}")
            comp = np.where(m.astype(bool), comp, BLOCKED)
        ext = np.concatenate([state.history.astype(np.int64), comp])  # [lookback + T]
        lb = self.lookback
        L, C = self._primes.shape
        H = self.layout.n_heads
        out = np.empty((T, L, C), dtype=np.int64)
        if T:
            blocked = np.zeros(T, dtype=bool)
            vals = []
            for s in range(lb + 1):
                v = ext[lb - s : lb - s + T]
                blocked |= v < 0
                vals.append(np.where(blocked, self.pad_compressed, v))
            # numpy int64 multiply/xor wrap like the reference's int64 arithmetic.
            with np.errstate(over="ignore"):
                rolling = vals[0][:, None] * self._mult[None, :, 0]  # [T, L]
                for s in range(1, lb + 1):
                    rolling = rolling ^ (vals[s][:, None] * self._mult[None, :, s])
                    cols = slice((s - 1) * H, s * H)
                    # np.mod is floor mod: non-negative for positive primes.
                    out[:, :, cols] = (
                        np.mod(rolling[:, :, None], self._primes[None, :, cols]) + self._offsets[None, :, cols]
                    )
        new_hist = ext[-lb:].copy() if lb else ext[:0].copy()
        return out, DecodeState(new_hist)
