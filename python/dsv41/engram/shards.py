"""Engram shard format and row-id checks: the ground the rest of ``dsv41.engram`` stands on.

Layout (docs/engram-spec.md sections 4-5): per Engram layer ``L`` two tensors in one safetensors
shard, ``layers.{L}.engram.embed.weight`` F8_E4M3 ``[rows, 256]`` and
``layers.{L}.engram.embed.scale`` F8_E8M0 ``[rows, 8]``, each one contiguous region.  Weight bytes
of row ``i`` start at ``8 + header_len + weight.data_offsets[0] + 256*i``, scale bytes at
``8 + header_len + scale.data_offsets[0] + 8*i``.  A packed row is weight then scale (264 B).

Every header is checked as the reference loader (``safetensors.safe_open``, safetensors
``Metadata::validate`` in ``safetensors/src/tensor.rs``) checks it, so a shard the serving
engine would refuse is refused here too, naming the file and the tensor: header length within
``100_000_000`` bytes and inside the file, a UTF-8 JSON object with no key twice,
``__metadata__`` a string map, each tensor a known dtype with a non-negative integer shape and
``data_offsets [begin, end]``, the tensors' byte ranges contiguous and non-overlapping from 0
(sorted by offset), each ``end - begin == prod(shape) * dtype bits / 8`` (whole bytes) and the
last ``end`` exactly the end of the file.  After these checks the reference loader itself opens
the file (it memory-maps it: reads only the header, whatever the shard's size) as a last word.

This module imports nothing else of ``dsv41.engram``.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dsv41 import fileio
from dsv41.errors import Dsv41Error, VerificationError

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "PAGE",
    "RowRangeError",
    "VerificationError",
    "check_row_ids",
    "read_safetensors_header",
    "scale_name",
    "shard_names",
    "table_regions",
    "validate_header",
    "weight_name",
]

PAGE = 4096
#: Largest header the reference loader accepts (safetensors ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000
#: Bits per element of every safetensors dtype (safetensors ``Dtype::bitsize``).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


class RowRangeError(Dsv41Error):
    """A requested row id is outside the table (or the layer has no table)."""


def check_row_ids(rows: ArrayLike, n_rows: int, layer_id: int) -> np.ndarray:
    """Validate global row ids of one table: ``rows`` int[N] (any integer dtype, 1-D) ->
    int64[N].  RowRangeError for a non-1-D / non-integer array or any id outside
    ``[0, n_rows)`` (naming the first bad id).  The one row-range check of the package: the
    local reader, the remote client and its fallback all use it."""
    r = np.asarray(rows)
    if r.ndim != 1 or (r.size and not np.issubdtype(r.dtype, np.integer)):
        raise RowRangeError("row ids must be a 1-D integer array")
    if r.size and r.dtype == np.uint64 and int(r.max()) >= (1 << 63):
        raise RowRangeError(f"row {int(r.max())} is outside layer {layer_id}'s table [0, {n_rows})")
    r = r.astype(np.int64, copy=False)
    if r.size and (int(r.min()) < 0 or int(r.max()) >= n_rows):
        bad = int(r[(r < 0) | (r >= n_rows)][0])
        raise RowRangeError(f"row {bad} is outside layer {layer_id}'s table [0, {n_rows})")
    return r


def weight_name(layer_id: int) -> str:
    """Tensor name of a layer's FP8 table (real checkpoint naming)."""
    return f"layers.{layer_id}.engram.embed.weight"


def scale_name(layer_id: int) -> str:
    """Tensor name of a layer's UE8M0 scales (real checkpoint naming)."""
    return f"layers.{layer_id}.engram.embed.scale"


def shard_names(n_layers: int) -> list[str]:
    """File names of the shards holding ``n_layers`` tables: the last ``n_layers`` shards of a
    48-shard checkpoint (``model-00047-of-00048``, ``model-00048-of-00048`` for V4.1-Flash)."""
    total = max(48, n_layers)
    first = total - n_layers + 1
    return [f"model-{first + i:05d}-of-{total:05d}.safetensors" for i in range(n_layers)]


def _uints(v: Any, n: int | None = None) -> bool:
    """Whether ``v`` is a list of non-negative ints (bools excluded), of length ``n`` if given."""
    return (
        isinstance(v, list)
        and (n is None or len(v) == n)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    )


def _check_tensors(p: Path, header: dict[str, Any], data_bytes: int) -> None:
    """The reference loader's ``Metadata::validate`` on a parsed header; VerificationError
    naming ``p`` and the tensor."""
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise VerificationError(f"{p}: safetensors __metadata__ must map strings to strings")
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise VerificationError(f"{p}: tensor {name}: header entry is not an object")
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise VerificationError(f"{p}: tensor {name}: unknown dtype {dtype!r}")
        if not _uints(shape):
            raise VerificationError(f"{p}: tensor {name}: shape must be a list of non-negative ints, got {shape!r}")
        if not _uints(offs, 2):
            raise VerificationError(f"{p}: tensor {name}: data_offsets must be [begin, end] byte offsets, got {offs!r}")
        spans.append((offs[0], offs[1], name, dtype, shape))
    end = 0
    for begin, stop, name, dtype, shape in sorted(spans, key=lambda s: (s[0], s[1])):
        if begin != end or stop < begin:
            raise VerificationError(
                f"{p}: tensor {name}: data_offsets must be contiguous and non-overlapping from 0, got "
                f"[{begin}, {stop}] where the previous tensor ends at {end}"
            )
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != stop - begin:
            raise VerificationError(
                f"{p}: tensor {name}: {dtype} {shape} is {bits / 8:g} bytes, data_offsets [{begin}, {stop}] "
                f"hold {stop - begin}"
            )
        end = stop
    if end < data_bytes:
        raise VerificationError(
            f"{p}: unindexed tail: the tensors cover data bytes [0, {end}) but the file "
            f"holds {data_bytes} after the header"
        )
    if end > data_bytes:
        raise VerificationError(
            f"{p}: truncated: the tensors cover data bytes [0, {end}) but the file holds "
            f"only {data_bytes} after the header"
        )


def _reference_loader_accepts(p: Path) -> None:
    """Open ``p`` with ``safetensors.safe_open`` (it memory-maps the file and parses only the
    header); VerificationError with its message if it refuses."""
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="numpy"):
            pass
    except Exception as exc:  # noqa: BLE001 - the loader raises SafetensorError / OSError / ValueError
        raise VerificationError(f"{p}: the safetensors loader refuses the header: {exc}") from None


def read_safetensors_header(path: str | os.PathLike, *, validate: bool = True) -> tuple[int, dict[str, Any]]:
    """Return ``(header_len, header)`` of a safetensors file after every check the reference
    loader makes (module docstring).  VerificationError naming the file (and the tensor, where
    one is at fault) for anything malformed, a missing or unreadable file, or a non-regular one.
    ``validate=False`` stops after the JSON object is read (length bounds, UTF-8, JSON object,
    no duplicate key); :func:`validate_header` then does the rest."""
    p = Path(path)
    try:
        with fileio.open_input(p, error=VerificationError) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise VerificationError(f"{p}: not a regular file")
            head = f.read(8)
            if len(head) < 8:
                raise VerificationError(f"{p}: too short for a safetensors header ({len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise VerificationError(f"{p}: safetensors header length {n} exceeds {MAX_HEADER_BYTES}")
            if 8 + n > st.st_size:
                raise VerificationError(
                    f"{p}: header truncated: safetensors header length {n} runs past "
                    f"the end of the {st.st_size}-byte file"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise VerificationError(f"{p}: file does not exist") from None
    except IsADirectoryError:
        raise VerificationError(f"{p}: not a regular file") from None
    except OSError as exc:
        raise VerificationError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if len(raw) < n:
        raise VerificationError(f"{p}: header truncated ({len(raw)} of {n} bytes)")
    try:
        header = fileio.loads_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise VerificationError(f"{p}: safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise VerificationError(f"{p}: safetensors header is not a JSON object")
    if validate:
        validate_header(p, n, header)
    return n, header


def validate_header(path: str | os.PathLike, header_len: int, header: dict[str, Any]) -> None:
    """The reference loader's tensor checks on a header read by :func:`read_safetensors_header`
    (module docstring), then ``safe_open`` itself; VerificationError naming file and tensor."""
    p = Path(path)
    try:
        size = os.stat(p).st_size
    except OSError as exc:
        raise VerificationError(f"{p}: cannot stat: {exc.strerror or exc}") from None
    _check_tensors(p, header, size - 8 - header_len)
    _reference_loader_accepts(p)


def table_regions(path: str | os.PathLike, layer_id: int, row_bytes: int = 264) -> dict[str, int]:
    """Locate a layer's table in a shard: dict(rows, weight_offset, scale_offset,
    weight_bytes, scale_bytes) with absolute byte offsets.  VerificationError when the header
    is malformed (:func:`read_safetensors_header`), the tensors are absent or have the wrong
    dtype/shape, or the row geometry is not ``row_bytes``."""
    n, hdr = read_safetensors_header(path, validate=False)
    out: dict[str, int] = {}
    # the table's own tensors first, so their errors say what an Engram table must be
    for kind, name, dtype in (("weight", weight_name(layer_id), "F8_E4M3"), ("scale", scale_name(layer_id), "F8_E8M0")):
        t = hdr.get(name)
        if not isinstance(t, dict):
            raise VerificationError(f"{path}: tensor {name} not found")
        shape, offs = t.get("shape"), t.get("data_offsets")
        if t.get("dtype") != dtype or not _uints(shape, 2) or shape[0] < 1 or shape[1] < 1:
            raise VerificationError(f"{path}: {name} must be {dtype} [rows, n], got {t.get('dtype')} {shape}")
        if not _uints(offs, 2):
            raise VerificationError(f"{path}: {name} data_offsets must be [begin, end] byte offsets, got {offs!r}")
        out[f"{kind}_offset"] = 8 + n + offs[0]
        out[f"{kind}_bytes"] = shape[1]
        out.setdefault("rows", shape[0])
        if shape[0] != out["rows"]:
            raise VerificationError(f"{path}: weight and scale of layer {layer_id} differ in rows")
    validate_header(path, n, hdr)
    if out["weight_bytes"] + out["scale_bytes"] != row_bytes:
        raise VerificationError(
            f"{path}: layer {layer_id} rows are {out['weight_bytes']}+{out['scale_bytes']} B, expected {row_bytes}"
        )
    return out
