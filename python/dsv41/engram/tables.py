"""Engram table files: the safetensors shard layout, the synthetic writer, the local row reader
and the dequantization reference.

Layout (engram-spec.md sections 4-5): per Engram layer ``L`` two tensors in one shard,
``layers.{L}.engram.embed.weight`` F8_E4M3 ``[rows, 256]`` and ``layers.{L}.engram.embed.scale``
F8_E8M0 ``[rows, 8]``, each one contiguous region.  Weight bytes of row ``i`` start at
``8 + header_len + weight.data_offsets[0] + 256*i``, scale bytes at
``8 + header_len + scale.data_offsets[0] + 8*i``.  A packed row is weight then scale (264 B).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from dsv41.engram.layout import EngramLayout
from dsv41.errors import Dsv41Error, VerificationError

PAGE = 4096
#: Rows per deterministic block of synthetic data (each block has its own seed sequence).
SYNTH_BLOCK_ROWS = 65536
#: First byte of the weight region of shard ``li`` is ``664 + 8*li`` (like the real 664/672):
#: not page-aligned, so 1 row in 16 straddles a 4 KiB page.
SYNTH_WEIGHT_START = 664


class RowRangeError(Dsv41Error):
    """A requested row id is outside the table (or the layer has no table)."""


def check_row_ids(rows: Any, n_rows: int, layer_id: int) -> np.ndarray:
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


def read_safetensors_header(path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """Return ``(header_len, header)`` of a safetensors file; VerificationError if malformed."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise VerificationError(f"{p}: too short for a safetensors header ({len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 1024 * 1024:
                raise VerificationError(f"{p}: implausible safetensors header length {n}")
            raw = f.read(n)
    except FileNotFoundError:
        raise VerificationError(f"{p}: file does not exist") from None
    except OSError as exc:
        raise VerificationError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if len(raw) < n:
        raise VerificationError(f"{p}: header truncated ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerificationError(f"{p}: safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise VerificationError(f"{p}: safetensors header is not a JSON object")
    return n, header


def _uints(v: Any, n: int) -> bool:
    """Whether ``v`` is a list of ``n`` non-negative ints (bools excluded)."""
    return isinstance(v, list) and len(v) == n and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def table_regions(path: str | os.PathLike, layer_id: int, row_bytes: int = 264) -> dict[str, int]:
    """Locate a layer's table in a shard: dict(rows, weight_offset, scale_offset,
    weight_bytes, scale_bytes) with absolute byte offsets.  VerificationError when the tensors
    are absent, have the wrong dtype/shape, malformed data_offsets, or end beyond the file."""
    n, hdr = read_safetensors_header(path)
    out: dict[str, int] = {}
    for kind, name, dtype in (("weight", weight_name(layer_id), "F8_E4M3"), ("scale", scale_name(layer_id), "F8_E8M0")):
        t = hdr.get(name)
        if not isinstance(t, dict):
            raise VerificationError(f"{path}: tensor {name} not found")
        shape, offs = t.get("shape"), t.get("data_offsets")
        if t.get("dtype") != dtype or not _uints(shape, 2) or shape[0] < 1 or shape[1] < 1:
            raise VerificationError(f"{path}: {name} must be {dtype} [rows, n], got {t.get('dtype')} {shape}")
        if not _uints(offs, 2) or offs[0] > offs[1]:
            raise VerificationError(f"{path}: {name} data_offsets must be [begin, end] byte offsets, got {offs!r}")
        if offs[1] - offs[0] != shape[0] * shape[1]:
            raise VerificationError(f"{path}: {name} data_offsets {offs} do not match shape {shape}")
        out[f"{kind}_offset"] = 8 + n + offs[0]
        out[f"{kind}_bytes"] = shape[1]
        out.setdefault("rows", shape[0])
        if shape[0] != out["rows"]:
            raise VerificationError(f"{path}: weight and scale of layer {layer_id} differ in rows")
    size = os.stat(path).st_size
    for kind in ("weight", "scale"):
        end = out[f"{kind}_offset"] + out["rows"] * out[f"{kind}_bytes"]
        if end > size:
            raise VerificationError(f"{path}: truncated: {size} bytes, the {kind} region of layer {layer_id} ends at {end}")
    if out["weight_bytes"] + out["scale_bytes"] != row_bytes:
        raise VerificationError(
            f"{path}: layer {layer_id} rows are {out['weight_bytes']}+{out['scale_bytes']} B, expected {row_bytes}"
        )
    return out


# --------------------------------------------------------------------------- synthetic tables


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


def synthetic_rows(seed: int, layer_id: int, total_rows: int, rows: np.ndarray, wb: int = 256, sb: int = 8) -> np.ndarray:
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
        return {"size": self.size, "sha256": self.file_sha.hexdigest(), "chunk_size": self.chunk_size, "chunks": self.chunks}


def table_header_bytes(layer_id: int, rows: int, wb: int, sb: int, weight_start: int, meta: dict[str, str]) -> bytes:
    """8-byte length + JSON header padded with spaces so the weight region starts at
    ``weight_start`` (+ a multiple of 4096 if the JSON is longer)."""
    hdr = {
        "__metadata__": meta,
        weight_name(layer_id): {"dtype": "F8_E4M3", "shape": [rows, wb], "data_offsets": [0, rows * wb]},
        scale_name(layer_id): {"dtype": "F8_E8M0", "shape": [rows, sb], "data_offsets": [rows * wb, rows * (wb + sb)]},
    }
    js = json.dumps(hdr, separators=(",", ":")).encode()
    target = weight_start
    while target - 8 < len(js):
        target += PAGE
    n = target - 8
    return struct.pack("<Q", n) + js + b" " * (n - len(js))


def write_table_shard(path: Path, layer_id: int, rows: int, seed: int, weight_start: int,
                      wb: int = 256, sb: int = 8, chunk_size: int = 32 << 20) -> dict[str, Any]:
    """Stream one synthetic shard to ``path`` (memory: one block of rows at a time).

    Returns the file record (size, sha256, chunk_size, chunks) plus ``regions``
    (weight/scale sha256) and the table's absolute ``weight_offset``/``scale_offset``.
    """
    w = HashingWriter(path, chunk_size)
    try:
        head = table_header_bytes(layer_id, rows, wb, sb, weight_start,
                                  {"format": "pt", "dsv41": SYNTH_MARK, "seed": str(seed)})
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
        _, hdr = read_safetensors_header(path)
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
            doc = json.loads(mp.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == "dsv41-engram-manifest" else None
        if not isinstance(files, list):
            raise Dsv41Error(f"{mp} exists and is not a dsv41 manifest: refusing to replace it (use --force)")
        for f in files:
            fp = out / str(f.get("name", "")) if isinstance(f, dict) else None
            if fp is not None and fp.is_file() and not _is_synthetic_shard(fp):
                raise Dsv41Error(f"{mp} describes {fp.name}, which is not a make-tables shard: refusing to "
                                 "replace the manifest (use --force)")


def write_synthetic_tables(cfg: Any, out_dir: str | os.PathLike, seed: int = 0, *,
                           revision: str | None = None, chunk_size: int = 32 << 20,
                           rows_override: list[int] | None = None, force: bool = False) -> Path:
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

    from dsv41.engram import manifest as mf

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
                rec = write_table_shard(tmps[li], layer, rows_of[li], seed, SYNTH_WEIGHT_START + 8 * li,
                                        layout.weight_bytes, layout.scale_bytes, chunk_size)
            except OSError as exc:
                raise Dsv41Error(f"cannot write {out / names[li]}: {exc.strerror or exc}") from None
            files.append({"name": names[li], **{k: rec[k] for k in ("size", "sha256", "chunk_size", "chunks")}})
            tables.append(mf.make_table_entry(layout, li, names[li], rows_of[li], rec["weight_offset"],
                                              rec["scale_offset"], rec["regions"]["weight"], rec["regions"]["scale"]))
        man = mf.Manifest(revision=revision or f"synthetic-seed{seed}", layout=mf.layout_params(layout),
                          files=files, tables=tables)
        mf.manifest_from_dict(man.to_dict(), "new manifest")  # schema self-check before replacing anything
        path = out / "manifest.json"
        try:
            if os.path.lexists(path):
                os.unlink(path)  # no stale manifest may describe the shards while they change
            for tmp, name in zip(tmps, names):
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


# --------------------------------------------------------------------------- local row reader

#: Largest single read (pages) when coalescing adjacent windows.
MAX_RUN_PAGES = 64
#: Bytes of aligned buffer a reader thread fills before gathering rows out of it.
BATCH_BYTES = 8 << 20


def open_table_file(path: str | os.PathLike, direct: bool = True) -> tuple[int, bool]:
    """Open a shard read-only: ``(fd, is_direct)``.  O_DIRECT when asked and the file system
    allows it (EINVAL, e.g. tmpfs, falls back to buffered).  The file must be a regular file:
    OSError(EISDIR / EINVAL "not a regular file") otherwise - a FIFO would block reads forever,
    so it is opened non-blocking and checked before any read.  Shared by the local reader and
    the table server's loader."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    is_direct = False
    fd = -1
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, flags | os.O_DIRECT)
            is_direct = True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: the file system refuses O_DIRECT (tmpfs)
                raise
    if fd < 0:
        fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd, is_direct


class _TableFile:
    """One open shard: fd, whether it is O_DIRECT, and the lock guarding a fallback switch."""

    def __init__(self, path: Path, direct: bool) -> None:
        self.path = path
        self.direct = False
        self.lock = threading.Lock()
        self.fd, self.direct = open_table_file(path, direct)

    def fall_back(self, fd_seen: int) -> None:
        """Switch to buffered I/O after the kernel refused an O_DIRECT read (EINVAL)."""
        with self.lock:
            if self.fd == fd_seen and self.direct:
                self.fd, self.direct = open_table_file(self.path, direct=False)
                self._old = fd_seen  # closed in close(): other threads may still use it

    def close(self) -> None:
        for fd in {self.fd, getattr(self, "_old", self.fd)}:
            try:
                os.close(fd)
            except OSError:
                pass


def _gather(arr: np.ndarray, pos: np.ndarray, width: int, region_offset: int) -> np.ndarray:
    """Rows ``arr[pos[k] : pos[k]+width]`` as uint8[K, width].

    Buffers hold whole pages, so when ``width`` divides the page size every row of a region
    sits at the same residue mod ``width``: view the buffer as rows and index whole rows
    (a memcpy each) instead of building a K x width byte index.
    """
    if PAGE % width == 0:
        r = region_offset % width
        nrows = (arr.size - r) // width
        return arr[r : r + nrows * width].reshape(nrows, width)[(pos - r) // width]
    return arr[pos[:, None] + np.arange(width)]


class LocalRowReader:
    """Batched exact reads of packed Engram rows from the local shards.

    ``manifest``: a :class:`~dsv41.engram.manifest.Manifest` (or anything with ``.tables`` of
    TableEntry-like objects); ``data_dir``: directory of the shard files.  Reads use O_DIRECT
    with 4 KiB-aligned windows (8 KiB where a row straddles a page), adjacent windows coalesced
    into one read of up to MAX_RUN_PAGES pages; where O_DIRECT is refused (EINVAL, e.g. tmpfs)
    the file is read buffered with the same windows.  ``threads`` workers issue ``preadv``
    concurrently (it releases the GIL), giving that queue depth.

    Counters (``stats``): reads (syscalls), bytes_read, rows.
    """

    def __init__(self, manifest: Any, data_dir: str | os.PathLike, threads: int = 16, direct: bool = True) -> None:
        if threads < 1:
            raise Dsv41Error(f"threads must be >= 1, got {threads}")
        self.data_dir = Path(data_dir)
        self.tables = {t.layer_id: t for t in manifest.tables}
        self.threads = threads
        self.batch_factor = 1  # tasks per thread for small requests (more only costs CPU on 2 cores)
        self.direct = direct
        self._files: dict[str, _TableFile] = {}
        self._open_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="engram-read") if threads > 1 else None
        self._local = threading.local()
        self._stats_lock = threading.Lock()
        self.stats = {"reads": 0, "bytes_read": 0, "rows": 0}
        self._closed = False

    # -- helpers
    def _file(self, name: str) -> _TableFile:
        with self._open_lock:
            tf = self._files.get(name)
            if tf is None:
                p = self.data_dir / name
                try:
                    tf = _TableFile(p, self.direct)
                except FileNotFoundError:
                    raise Dsv41Error(f"table file {p} does not exist") from None
                except OSError as exc:
                    raise Dsv41Error(f"cannot open table file {p}: {exc.strerror or exc}") from None
                self._files[name] = tf
            return tf

    def is_direct(self, layer_id: int) -> bool:
        """Whether the shard of ``layer_id`` is currently read with O_DIRECT."""
        return self._file(self._table(layer_id).file).direct

    def _table(self, layer_id: int) -> Any:
        t = self.tables.get(layer_id)
        if t is None:
            raise RowRangeError(f"no Engram table for layer {layer_id} (layers: {sorted(self.tables)})")
        return t

    def _buffer(self, size: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            # anonymous mmap: page-aligned, as O_DIRECT requires
            buf = mmap.mmap(-1, max(size, BATCH_BYTES))
            self._local.buf = buf
        return memoryview(buf)

    # -- public API
    def read(self, layer_id: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Read packed rows: ``rows`` int[N] global row ids of ``layer_id``'s table ->
        uint8[N, row_bytes] (weight then scale) in request order (duplicates allowed).

        Raises RowRangeError for ids outside ``[0, rows)`` or an unknown layer, Dsv41Error for a
        bad ``out`` buffer, an unreadable file or a short read.
        """
        if self._closed:
            raise Dsv41Error("LocalRowReader is closed")
        t = self._table(layer_id)
        ids = check_row_ids(rows, t.rows, layer_id)
        n = ids.shape[0]
        if out is None:
            out = np.empty((n, t.row_bytes), dtype=np.uint8)
        elif out.dtype != np.uint8 or out.shape != (n, t.row_bytes) or not out.flags.c_contiguous:
            raise Dsv41Error(f"out must be a C-contiguous uint8[{n}, {t.row_bytes}] array, got {out.dtype}{list(out.shape)}")
        if n == 0:
            return out
        tf = self._file(t.file)
        wb, sb = t.weight_bytes, t.scale_bytes
        # items: one per (request position, region); absolute byte start and length
        starts = np.concatenate([t.weight_offset + ids * wb, t.scale_offset + ids * sb])
        lens = np.concatenate([np.full(n, wb, np.int64), np.full(n, sb, np.int64)])
        p0 = starts // PAGE
        p1 = (starts + lens - 1) // PAGE
        order = np.argsort(p0, kind="stable")
        sp0, sp1 = p0[order], p1[order]
        # runs of overlapping/adjacent windows (cummax of ends), split every MAX_RUN_PAGES
        end_max = np.maximum.accumulate(sp1)
        new_run = np.ones(sp0.size, dtype=bool)
        new_run[1:] = sp0[1:] > end_max[:-1] + 1
        run_id = np.cumsum(new_run) - 1
        run_start = sp0[new_run][run_id]
        key = run_id * (1 << 24) + (sp0 - run_start) // MAX_RUN_PAGES
        new_piece = np.ones(sp0.size, dtype=bool)
        new_piece[1:] = key[1:] != key[:-1]
        piece_of = np.cumsum(new_piece) - 1
        first = np.nonzero(new_piece)[0]
        piece_p0 = sp0[first]
        piece_p1 = np.maximum.reduceat(sp1, first)
        piece_bytes = (piece_p1 - piece_p0 + 1) * PAGE
        # batches: consecutive pieces, <= BATCH_BYTES each and at least `threads` batches when possible
        total = int(piece_bytes.sum())
        # small requests: about one piece per task (queue depth); large: <= BATCH_BYTES per task
        per = max(PAGE, min(BATCH_BYTES, -(-total // min(piece_p0.size, self.batch_factor * self.threads))))
        per = -(-per // PAGE) * PAGE  # piece positions stay page-aligned (O_DIRECT needs it)
        cum = np.cumsum(piece_bytes) - piece_bytes
        batch_of_piece = cum // per
        # re-cut where a batch would overflow its buffer (pieces are <= MAX_RUN_PAGES+1 pages)
        piece_pos = cum - batch_of_piece * per  # offset of the piece inside its batch buffer
        item_piece = np.empty_like(piece_of)
        item_piece[order] = piece_of
        item_batch = batch_of_piece[item_piece]
        item_pos = piece_pos[item_piece] + (starts - piece_p0[item_piece] * PAGE)
        nb = int(batch_of_piece[-1]) + 1
        pb = np.searchsorted(batch_of_piece, np.arange(nb + 1))
        ib_order = np.argsort(item_batch, kind="stable")
        ib = np.searchsorted(item_batch[ib_order], np.arange(nb + 1))
        bufmax = int((piece_pos + piece_bytes).max())

        def do_batch(b: int) -> None:
            buf = self._buffer(bufmax)
            a, z = int(pb[b]), int(pb[b + 1])
            nreads = 0
            nbytes = 0
            for k in range(a, z):
                pos = int(piece_pos[k])
                size = int(piece_bytes[k])
                off = int(piece_p0[k]) * PAGE
                got = self._pread(tf, buf[pos : pos + size], off)
                nreads += 1
                nbytes += got
                # the file may end inside the last page: only the bytes rows need must be there
                need_end = int(piece_p1[k]) * PAGE + PAGE
                if got < size and off + got < min(need_end, self._needed_end(starts, lens, item_piece, k)):
                    raise Dsv41Error(f"{tf.path}: truncated: a read at byte {off} got {got} of {size} bytes "
                                     f"(is the shard shorter than its manifest says? run dsv41 engram verify)")
            arr = np.frombuffer(buf, dtype=np.uint8, count=bufmax)
            items = ib_order[ib[b] : ib[b + 1]]
            w = items[items < n]
            s = items[items >= n]
            if w.size:
                out[w, :wb] = _gather(arr, item_pos[w], wb, t.weight_offset)
            if s.size:
                out[s - n, wb:] = _gather(arr, item_pos[s], sb, t.scale_offset)
            with self._stats_lock:
                self.stats["reads"] += nreads
                self.stats["bytes_read"] += nbytes

        if self._pool is None or nb == 1:
            for b in range(nb):
                do_batch(b)
        else:
            for f in [self._pool.submit(do_batch, b) for b in range(nb)]:
                f.result()
        with self._stats_lock:
            self.stats["rows"] += n
        return out

    @staticmethod
    def _needed_end(starts: np.ndarray, lens: np.ndarray, item_piece: np.ndarray, k: int) -> int:
        sel = item_piece == k
        return int((starts[sel] + lens[sel]).max())

    def _pread(self, tf: _TableFile, dst: memoryview, off: int) -> int:
        fd = tf.fd
        try:
            return os.preadv(fd, [dst], off)
        except OSError as exc:
            # EINVAL on an O_DIRECT fd (ours, or one another thread just replaced): the file
            # system refuses direct reads here -> buffered from now on.
            if exc.errno == errno.EINVAL and (tf.direct or fd != tf.fd):
                tf.fall_back(fd)
                try:
                    return os.preadv(tf.fd, [dst], off)
                except OSError as exc2:
                    exc = exc2
            raise Dsv41Error(f"read of {tf.path} at byte {off} failed: {exc.strerror or exc}") from None

    def close(self) -> None:
        """Stop the thread pool and close the files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for tf in self._files.values():
            tf.close()
        self._files.clear()

    def __enter__(self) -> LocalRowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- dequantization


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
