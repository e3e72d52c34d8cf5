"""Synthetic Engram tables: deterministic shards in the real layout (``dsv41 engram
make-tables``), their expected rows without reading the files, and the one-pass hashing writer.

Layout: :mod:`dsv41.engram.shards`.  Rows come in blocks of ``SYNTH_BLOCK_ROWS``, each block
from its own seed sequence ``[seed, layer_id, block, 0|1]`` (weight|scale).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from dsv41 import fileio
from dsv41.engram import manifest as mf
from dsv41.engram.layout import EngramLayout
from dsv41.engram.shards import PAGE, RowRangeError, read_safetensors_header, scale_name, shard_names, weight_name
from dsv41.errors import Dsv41Error, VerificationError

#: Rows per deterministic block of synthetic data (each block has its own seed sequence).
SYNTH_BLOCK_ROWS = 65536
#: First byte of the weight region of shard ``li`` is ``664 + 8*li`` (like the real 664/672):
#: not page-aligned, so 1 row in 16 straddles a 4 KiB page.
SYNTH_WEIGHT_START = 664


def _block_weight(seed: int, layer_id: int, blk: int, n: int, wb: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, layer_id, blk, 0])))
    w = np.frombuffer(rng.bytes(n * wb), dtype=np.uint8).reshape(n, wb).copy()
    # 0x7F/0xFF are the E4M3FN NaN encodings: real checkpoints have none.
    nan = (w & 0x7F) == 0x7F
    w[nan] ^= 0x01
    return w


def _block_scale(seed: int, layer_id: int, blk: int, n: int, sb: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, layer_id, blk, 1])))
    s = rng.integers(112, 136, size=(n, sb), dtype=np.uint8)  # 2^-15 .. 2^8
    u = rng.random((n, sb))
    # A few 0 and 255 scale bytes, decoded differently by the reference and vLLM (spec 4).
    s[u < 1 / 2048] = 0
    s[u > 1 - 1 / 2048] = 255
    if blk == 0:
        if n > 1:
            s[1, 0] = 0
        if n > 2:
            s[2, sb - 1] = 255
    return s


def synthetic_rows(
    seed: int, layer_id: int, total_rows: int, rows: np.ndarray, wb: int = 256, sb: int = 8
) -> np.ndarray:
    """Expected packed rows ``uint8[N, wb+sb]`` of a table written by :func:`write_synthetic_tables`
    (for tests and exactness checks without reading the files).  RowRangeError if out of range."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= total_rows):
        raise RowRangeError(f"row ids must be in [0, {total_rows})")
    out = np.empty((rows.size, wb + sb), dtype=np.uint8)
    blks = rows // SYNTH_BLOCK_ROWS
    for blk in np.unique(blks):
        sel = np.nonzero(blks == blk)[0]
        n = min(SYNTH_BLOCK_ROWS, total_rows - int(blk) * SYNTH_BLOCK_ROWS)
        local = rows[sel] - blk * SYNTH_BLOCK_ROWS
        out[sel, :wb] = _block_weight(seed, layer_id, int(blk), n, wb)[local]
        out[sel, wb:] = _block_scale(seed, layer_id, int(blk), n, sb)[local]
    return out


class HashingWriter:
    """File writer that hashes as it writes: whole-file sha256, per-chunk sha256 and named
    region sha256s (``begin_region``/``end_region``).  Used so ``make-tables`` needs one pass."""

    def __init__(self, path: Path, chunk_size: int) -> None:
        self.f = open(path, "wb")
        self.chunk_size = chunk_size
        self.file_sha = hashlib.sha256()
        self.chunk_sha = hashlib.sha256()
        self.chunk_fill = 0
        self.chunks: list[str] = []
        self.size = 0
        self.regions: dict[str, str] = {}
        self._region: tuple[str, Any] | None = None

    def begin_region(self, name: str) -> None:
        """Start hashing the bytes written from now on as region ``name`` (e.g. "weight")."""
        self._region = (name, hashlib.sha256())

    def end_region(self) -> None:
        """Finish the current region; its hex sha256 goes to ``regions[name]``."""
        assert self._region is not None
        self.regions[self._region[0]] = self._region[1].hexdigest()
        self._region = None

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` (any buffer; bytes) to the file and every running hash.  OSError
        from the file system propagates."""
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.file_sha.update(mv)
        if self._region is not None:
            self._region[1].update(mv)
        self.size += len(mv)
        while len(mv):
            take = min(len(mv), self.chunk_size - self.chunk_fill)
            self.chunk_sha.update(mv[:take])
            self.chunk_fill += take
            mv = mv[take:]
            if self.chunk_fill == self.chunk_size:
                self.chunks.append(self.chunk_sha.hexdigest())
                self.chunk_sha = hashlib.sha256()
                self.chunk_fill = 0

    def close(self) -> dict[str, Any]:
        """Close the file; returns ``{size (bytes), sha256, chunk_size, chunks: [sha256 per chunk]}``."""
        if self.chunk_fill:
            self.chunks.append(self.chunk_sha.hexdigest())
        self.f.close()
        return {
            "size": self.size,
            "sha256": self.file_sha.hexdigest(),
            "chunk_size": self.chunk_size,
            "chunks": self.chunks,
        }


def table_header_bytes(layer_id: int, rows: int, wb: int, sb: int, weight_start: int, meta: dict[str, str]) -> bytes:
    """8-byte length + JSON header padded with spaces so the weight region starts at
    ``weight_start`` (+ a multiple of 4096 if the JSON is longer)."""
    hdr = {
        "__metadata__": meta,
        weight_name(layer_id): {"dtype": "F8_E4M3", "shape": [rows, wb], "data_offsets": [0, rows * wb]},
        scale_name(layer_id): {"dtype": "F8_E8M0", "shape": [rows, sb], "data_offsets": [rows * wb, rows * (wb + sb)]},
    }
    js = fileio.dumps_json(hdr, separators=(",", ":")).encode()
    target = weight_start
    while target - 8 < len(js):
        target += PAGE
    n = target - 8
    return struct.pack("<Q", n) + js + b" " * (n - len(js))


def write_table_shard(
    path: Path,
    layer_id: int,
    rows: int,
    seed: int,
    weight_start: int,
    wb: int = 256,
    sb: int = 8,
    chunk_size: int = 32 << 20,
) -> dict[str, Any]:
    """Stream one synthetic shard to ``path`` (memory: one block of rows at a time).

    Returns the file record (size, sha256, chunk_size, chunks) plus ``regions``
    (weight/scale sha256) and the table's absolute ``weight_offset``/``scale_offset``.
    """
    w = HashingWriter(path, chunk_size)
    try:
        head = table_header_bytes(
            layer_id, rows, wb, sb, weight_start, {"format": "pt", "dsv41": SYNTH_MARK, "seed": str(seed)}
        )
        w.write(head)
        nblk = -(-rows // SYNTH_BLOCK_ROWS)
        w.begin_region("weight")
        for blk in range(nblk):
            n = min(SYNTH_BLOCK_ROWS, rows - blk * SYNTH_BLOCK_ROWS)
            w.write(_block_weight(seed, layer_id, blk, n, wb).data)
        w.end_region()
        w.begin_region("scale")
        for blk in range(nblk):
            n = min(SYNTH_BLOCK_ROWS, rows - blk * SYNTH_BLOCK_ROWS)
            w.write(_block_scale(seed, layer_id, blk, n, sb).data)
        w.end_region()
    except BaseException:
        w.f.close()
        raise
    rec = w.close()
    rec["regions"] = w.regions
    rec["weight_offset"] = len(head)
    rec["scale_offset"] = len(head) + rows * wb
    return rec


SYNTH_MARK = "synthetic engram table"


def _is_synthetic_shard(path: Path) -> bool:
    """Whether ``path`` is a shard written by :func:`write_synthetic_tables` (header metadata)."""
    try:
        _, hdr = read_safetensors_header(path, validate=False)  # only the mark: a damaged own shard stays replaceable
    except VerificationError:
        return False
    meta = hdr.get("__metadata__")
    return isinstance(meta, dict) and meta.get("dsv41") == SYNTH_MARK


def _check_replaceable(out: Path, names: list[str]) -> None:
    """Refuse (Dsv41Error) when writing ``names`` + manifest.json into ``out`` would replace a
    file that is not earlier make-tables output (e.g. a real checkpoint shard)."""

    for name in names:
        p = out / name
        if os.path.lexists(p) and not (p.is_file() and _is_synthetic_shard(p)):
            raise Dsv41Error(f"{p} exists and is not a make-tables shard: refusing to replace it (use --force)")
    mp = out / "manifest.json"
    if os.path.lexists(mp):
        try:
            doc = fileio.read_json(mp)
        except fileio.FileError:
            doc = None
        files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == "dsv41-engram-manifest" else None
        if not isinstance(files, list):
            raise Dsv41Error(f"{mp} exists and is not a dsv41 manifest: refusing to replace it (use --force)")
        for f in files:
            fp = out / str(f.get("name", "")) if isinstance(f, dict) else None
            if fp is not None and fp.is_file() and not _is_synthetic_shard(fp):
                raise Dsv41Error(
                    f"{mp} describes {fp.name}, which is not a make-tables shard: refusing to "
                    "replace the manifest (use --force)"
                )


def write_synthetic_tables(
    cfg: Any,
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    revision: str | None = None,
    chunk_size: int = 32 << 20,
    rows_override: list[int] | None = None,
    force: bool = False,
) -> Path:
    """Write one synthetic shard per Engram layer plus ``manifest.json`` into ``out_dir``.

    ``cfg``: config path/mapping or an :class:`EngramLayout`.  Deterministic from ``seed``
    (an int in [0, 2^63)).  ``rows_override`` (tests/benchmarks only) writes tables of other
    sizes with the same format; the manifest records the rows actually written.  Returns the
    manifest path.

    Crash safety: shards go to hidden temporary names and are renamed into place only when all
    of them are complete; the old manifest is removed before the renames and the new one written
    (atomically) last, so an interrupted or failed run never leaves a manifest that verifies
    against half-written shards, and a failure while writing leaves earlier output untouched.
    Existing files that are not make-tables output (e.g. real shards of the same names) are
    never replaced unless ``force``.  Raises Dsv41Error for a bad seed, a refused replacement,
    too little free space, or a write error (temporary files are removed).
    """
    import shutil

    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < (1 << 63):
        raise Dsv41Error(f"seed must be an int in [0, 2^63), got {seed!r}")
    layout = cfg if isinstance(cfg, EngramLayout) else EngramLayout.from_config(cfg)
    n_layers = len(layout.layer_ids)
    if rows_override is not None and (len(rows_override) != n_layers or any(r < 1 for r in rows_override)):
        raise Dsv41Error(f"rows_override must give {n_layers} positive row counts, got {rows_override!r}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Dsv41Error(f"cannot create output directory {out}: {exc.strerror or exc}") from None
    names = shard_names(n_layers)

    for name in [*names, "manifest.json"]:
        fileio.check_output(out / name, "make-tables --out")  # never a FIFO, device, dir or symlink, even with --force
    if not force:
        _check_replaceable(out, names)
    rows_of = [layout.rows[li] if rows_override is None else rows_override[li] for li in range(n_layers)]
    need = sum(r * layout.row_bytes + PAGE * 2 for r in rows_of)
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = None
    if free is not None and need > free:
        raise Dsv41Error(f"{out}: the tables need {need} bytes ({need / 2**30:.1f} GiB), only {free} are free")
    tag = f".tmp{os.getpid()}"
    tmps = [out / f".{n}{tag}" for n in names]
    for n in names:  # leftovers of a run that was killed (SIGKILL, power loss) before cleaning up
        for stale in out.glob(f".{n}.tmp*"):
            try:
                stale.unlink()
            except OSError:
                pass
    files, tables = [], []
    try:
        for li, layer in enumerate(layout.layer_ids):
            try:
                rec = write_table_shard(
                    tmps[li],
                    layer,
                    rows_of[li],
                    seed,
                    SYNTH_WEIGHT_START + 8 * li,
                    layout.weight_bytes,
                    layout.scale_bytes,
                    chunk_size,
                )
            except OSError as exc:
                raise Dsv41Error(f"cannot write {out / names[li]}: {exc.strerror or exc}") from None
            files.append({"name": names[li], **{k: rec[k] for k in ("size", "sha256", "chunk_size", "chunks")}})
            tables.append(
                mf.make_table_entry(
                    layout,
                    li,
                    names[li],
                    rows_of[li],
                    rec["weight_offset"],
                    rec["scale_offset"],
                    rec["regions"]["weight"],
                    rec["regions"]["scale"],
                )
            )
        man = mf.Manifest(
            revision=revision or f"synthetic-seed{seed}", layout=mf.layout_params(layout), files=files, tables=tables
        )
        mf.manifest_from_dict(man.to_dict(), "new manifest")  # schema self-check before replacing anything
        path = out / "manifest.json"
        try:
            if os.path.lexists(path):
                os.unlink(path)  # no stale manifest may describe the shards while they change
            for tmp, name in zip(tmps, names, strict=False):
                os.replace(tmp, out / name)
        except OSError as exc:
            raise Dsv41Error(f"cannot move the new shards into {out}: {exc.strerror or exc}") from None
        man.save(path)
    finally:
        for tmp in tmps:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                pass
    return path
