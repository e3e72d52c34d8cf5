"""Dequantization reference of packed Engram rows (FP8 E4M3 values x UE8M0 block scales -> BF16).

engram-spec.md section 4; the two conventions for scale bytes 0 and 255 (the reference code's and
vLLM's kernel's) are both implemented.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dsv41.errors import Dsv41Error


def _e4m3fn_table() -> np.ndarray:
    """float32[256]: value of every E4M3FN byte (bias 7, no inf, 0x7F/0xFF NaN; OCP FP8 spec)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    val = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * np.exp2(e - 7.0))
    val = sign * val
    val[(b & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


_E4M3 = _e4m3fn_table()


def _round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the nearest bf16 (round half to even; NaN kept)."""
    u = x.view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    r = np.where(np.isnan(x), u | np.uint32(0x00400000), r)
    return r.astype(np.uint32).view(np.float32)


def dequantize(rows: np.ndarray, convention: str = "reference", backend: str = "torch") -> tuple[Any, dict[str, Any]]:
    """Dequantize packed rows uint8[N, 264] (weight_bytes + weight_bytes/32 scales) to BF16.

    Value j of row r = ``e4m3(W[r, j]) * 2^(S[r, j//32] - 127)`` in fp32, then rounded to bf16
    (engram-spec.md section 4).  Scale bytes 0 and 255: ``convention="reference"`` decodes them
    as 2^-127 and NaN (the reference code); ``"vllm"`` as 0.0 and +inf (vLLM's kernel).
    ``backend="torch"`` returns a torch.bfloat16 [N, 256]; ``"numpy"`` a float32 [N, 256] whose
    values are exactly bf16.  Second result: ``{"convention", "scale_zero", "scale_255"}``
    (counts of such scale bytes).  Dsv41Error on a bad shape/dtype/convention/backend.
    """
    if convention not in ("reference", "vllm"):
        raise Dsv41Error(f"convention must be 'reference' or 'vllm', got {convention!r}")
    if backend not in ("torch", "numpy"):
        raise Dsv41Error(f"backend must be 'torch' or 'numpy', got {backend!r}")
    r = np.asarray(rows)
    if r.dtype != np.uint8 or r.ndim != 2 or r.shape[1] % 33:
        raise Dsv41Error(f"rows must be uint8[N, 33*k] (264 for head_dim 256), got {r.dtype}{list(r.shape)}")
    wb = r.shape[1] // 33 * 32
    w, s = r[:, :wb], r[:, wb:]
    with np.errstate(over="ignore"):  # 255 -> 2^128 = inf in fp32; replaced below
        sc = np.exp2(s.astype(np.float32) - np.float32(127.0))  # 0 -> 2^-127 (subnormal fp32), exact
    n0 = int((s == 0).sum())
    n255 = int((s == 255).sum())
    if convention == "reference":
        sc[s == 255] = np.nan
    else:
        sc[s == 0] = 0.0
        sc[s == 255] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):  # 0*inf -> NaN as in the vLLM kernel's fp32 math
        vals = _E4M3[w].reshape(r.shape[0], -1, 32) * sc[:, :, None]
    vals = vals.reshape(r.shape[0], wb)
    counts = {"convention": convention, "scale_zero": n0, "scale_255": n255}
    if backend == "numpy":
        return _round_to_bf16(np.ascontiguousarray(vals, dtype=np.float32)), counts
    import torch

    return torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32)).to(torch.bfloat16), counts
