"""The local O_DIRECT row reader: batched exact reads of packed Engram rows from the shards.

Row ``i`` of a table: weight bytes at ``weight_offset + 256*i``, scale bytes at
``scale_offset + 8*i`` (absolute offsets from the manifest, checked against the shard's
safetensors header when a shard is first opened; :mod:`dsv41.engram.shards`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dsv41.engram.manifest import Manifest, TableEntry, check_table_header
from dsv41.engram.shards import PAGE, RowRangeError, check_row_ids
from dsv41.errors import Dsv41Error, VerificationError

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


def _key(st: os.stat_result) -> tuple[int, int, int, int]:
    """The identity a shard keeps while nobody writes it: (device, inode, size, mtime_ns)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _TableFile:
    """One open shard: fd, whether it is O_DIRECT, and the lock guarding a fallback switch."""

    def __init__(self, path: Path, direct: bool) -> None:
        self.path = path
        self.direct = False
        self.lock = threading.Lock()
        self.fd, self.direct = open_table_file(path, direct)
        st = os.fstat(self.fd)
        self.key = _key(st)  # what the file was when opened: a read checks it still is

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


def _what_changed(was: tuple, now: tuple) -> str:
    """Which of (device, inode, size, mtime) differ, in words."""
    if was[:2] != now[:2]:
        return "replaced by another file"
    if was[2] != now[2]:
        return f"size {was[2]} -> {now[2]} bytes"
    return "rewritten (modification time changed)"


class LocalRowReader:
    """Batched exact reads of packed Engram rows from the local shards.

    ``manifest``: a :class:`~dsv41.engram.manifest.Manifest`; ``data_dir``: directory of the shard
    files.  When a shard is first opened its safetensors header is checked as the reference loader
    checks it and must place every table of the manifest where the manifest says
    (:func:`~dsv41.engram.manifest.check_table_header`; VerificationError otherwise).  Reads use O_DIRECT
    with 4 KiB-aligned windows (8 KiB where a row straddles a page), adjacent windows coalesced
    into one read of up to MAX_RUN_PAGES pages; where O_DIRECT is refused (EINVAL, e.g. tmpfs)
    the file is read buffered with the same windows.  ``threads`` workers issue ``preadv``
    concurrently (it releases the GIL), giving that queue depth.

    Shards are watched: :meth:`verify` checks every shard against the manifest (size, sha256,
    header) and records each file's identity (device, inode, size, mtime); every :meth:`read`
    compares its shard's open descriptor with it (or, without :meth:`verify`, with what the file
    was when first opened) before and after reading, so a shard truncated or rewritten in place
    under a running reader raises VerificationError before a row read from it is returned; the
    reader then stays failed (``stale``: the reason) until it is rebuilt.

    Counters (``stats``): reads (syscalls), bytes_read, rows.
    """

    def __init__(self, manifest: Manifest, data_dir: str | os.PathLike, threads: int = 16, direct: bool = True) -> None:
        if threads < 1:
            raise Dsv41Error(f"threads must be >= 1, got {threads}")
        self.data_dir = Path(data_dir)
        self.manifest = manifest
        self.tables = {t.layer_id: t for t in manifest.tables}
        self.verified: dict[str, tuple[int, int, int, int]] = {}  # shard -> identity when verified
        self.stale: str | None = None
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
                try:
                    want = self.verified.get(name)
                    if want is not None and tf.key != want:
                        raise VerificationError(
                            f"table file {p} changed since it was verified "
                            f"({_what_changed(want, tf.key)}); restart to verify it again"
                        )
                    for t in self.tables.values():
                        if t.file == name:
                            check_table_header(p, t)
                except BaseException:
                    tf.close()
                    raise
                self._files[name] = tf
            return tf

    def verify(self) -> None:
        """Check every shard of the tables against the manifest before serving from them
        (:func:`dsv41.engram.manifest.verify`: present, its size, every chunk's sha256, the
        header) and record each one's identity for :meth:`read`'s watch. VerificationError
        naming the file and the problem (missing, truncated, changed, changed while hashed)."""
        from dsv41.engram import manifest as M

        names = sorted({t.file for t in self.tables.values()})
        before = {}
        for n in names:
            try:
                before[n] = _key(os.stat(self.data_dir / n))
            except FileNotFoundError:
                raise VerificationError(f"table file {self.data_dir / n} does not exist") from None
            except OSError as exc:
                raise VerificationError(f"cannot stat table file {self.data_dir / n}: {exc.strerror or exc}") from None
        M.verify(self.manifest, self.data_dir, only=names, mode="full", progress=False)
        for n in names:
            try:
                after = _key(os.stat(self.data_dir / n))
            except OSError:
                after = None
            if after != before[n]:
                raise VerificationError(f"table file {self.data_dir / n} changed while it was verified")
        with self._open_lock:
            self.verified = before
            for n, tf in self._files.items():  # opened before: they must be the verified files
                if tf.key != before.get(n, tf.key):
                    raise VerificationError(
                        f"table file {tf.path} open since before verification is not the verified file"
                    )

    def _watch(self, tf: _TableFile) -> None:
        """VerificationError (and ``stale`` set) when ``tf`` is no longer the file it was."""
        if self.stale is not None:
            raise VerificationError(self.stale)
        try:
            now = _key(os.fstat(tf.fd))
        except OSError as exc:
            now = None
            why = f"cannot stat it: {exc.strerror or exc}"
        if now != tf.key:
            if now is not None:
                why = _what_changed(tf.key, now)
            self.stale = (
                f"table file {tf.path} changed under the running reader ({why}); its rows no longer "
                "match the manifest: restart to verify it again"
            )
            raise VerificationError(self.stale)

    def is_direct(self, layer_id: int) -> bool:
        """Whether the shard of ``layer_id`` is currently read with O_DIRECT."""
        return self._file(self._table(layer_id).file).direct

    def _table(self, layer_id: int) -> TableEntry:
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
            raise Dsv41Error(
                f"out must be a C-contiguous uint8[{n}, {t.row_bytes}] array, got {out.dtype}{list(out.shape)}"
            )
        if n == 0:
            return out
        tf = self._file(t.file)
        self._watch(tf)
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
                    raise Dsv41Error(
                        f"{tf.path}: truncated: a read at byte {off} got {got} of {size} bytes "
                        f"(is the shard shorter than its manifest says? run dsv41 engram verify)"
                    )
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
        self._watch(tf)  # changed while it was read: none of these rows may be used
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
