"""Engram manifest: JSON (+ JSON Schema ``dsv41/schemas/manifest.schema.json``), table
identities and parallel chunked sha256 verification.

Identity of a table = sha256 of the sorted-key compact JSON of its layout parameters
(global hash parameters except ``layer_ids``, layer id, rows, row geometry, tensor names,
primes, offsets, multipliers) and its region hashes (sha256 of the weight and scale regions).
It names table *content*: the same table packed at other file offsets has the same identity.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsv41 import fileio
from dsv41.engram.layout import EngramLayout
from dsv41.engram.shards import RowRangeError, scale_name, shard_names, table_regions, weight_name
from dsv41.errors import VerificationError

FORMAT = "dsv41-engram-manifest"
VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "manifest.schema.json"
_READ_BLOCK = 4 << 20  # bytes per pread while hashing (hashlib releases the GIL on big updates)


@dataclass
class TableEntry:
    """One Engram table in a shard.  Offsets are absolute byte offsets in ``file``."""

    layer_id: int
    file: str
    weight_name: str
    scale_name: str
    rows: int
    row_bytes: int
    weight_bytes: int
    scale_bytes: int
    weight_offset: int
    scale_offset: int
    weight_sha256: str
    scale_sha256: str
    hash: dict[str, list[int]]
    identity: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the manifest's ``tables[i]``)."""
        return asdict(self)


def layout_params(layout: EngramLayout) -> dict[str, Any]:
    """The manifest's ``layout`` object (global hash parameters)."""
    return dict(layout.params)


def table_identity(layout: dict[str, Any], entry: dict[str, Any] | TableEntry) -> str:
    """Hex sha256 identity of a table (see module docstring for what it covers)."""
    e = entry.to_dict() if isinstance(entry, TableEntry) else entry
    doc = {
        "layout": {k: v for k, v in layout.items() if k != "layer_ids"},
        **{
            k: e[k]
            for k in (
                "layer_id",
                "rows",
                "row_bytes",
                "weight_bytes",
                "scale_bytes",
                "weight_name",
                "scale_name",
                "weight_sha256",
                "scale_sha256",
            )
        },
        "hash": e["hash"],
    }
    return hashlib.sha256(fileio.dumps_json(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def make_table_entry(
    layout: EngramLayout,
    li: int,
    file: str,
    rows: int,
    weight_offset: int,
    scale_offset: int,
    weight_sha256: str,
    scale_sha256: str,
) -> TableEntry:
    """Build a :class:`TableEntry` (identity computed) for table ``li`` of ``layout``."""
    layer = layout.layer_ids[li]
    e = TableEntry(
        layer_id=layer,
        file=file,
        weight_name=weight_name(layer),
        scale_name=scale_name(layer),
        rows=rows,
        row_bytes=layout.row_bytes,
        weight_bytes=layout.weight_bytes,
        scale_bytes=layout.scale_bytes,
        weight_offset=weight_offset,
        scale_offset=scale_offset,
        weight_sha256=weight_sha256,
        scale_sha256=scale_sha256,
        hash={"primes": layout.primes[li], "offsets": layout.offsets[li], "multipliers": layout.multipliers[li]},
        identity="",
    )
    e.identity = table_identity(layout_params(layout), e)
    return e


@dataclass
class Manifest:
    """A loaded manifest.  ``files``: list of dicts (name, size, sha256, chunk_size, chunks);
    ``tables``: list of :class:`TableEntry`; ``path``: where it was loaded from (or None)."""

    revision: str
    layout: dict[str, Any]
    files: list[dict[str, Any]]
    tables: list[TableEntry]
    path: Path | None = field(default=None, compare=False)

    def table(self, layer_id: int) -> TableEntry:
        """The table of ``layer_id``; RowRangeError (a Dsv41Error) if the manifest has none."""
        for t in self.tables:
            if t.layer_id == layer_id:
                return t
        raise RowRangeError(f"manifest has no table for layer {layer_id} (layers: {[t.layer_id for t in self.tables]})")

    def file(self, name: str) -> dict[str, Any]:
        """The ``files`` record called ``name`` (KeyError if absent)."""
        for f in self.files:
            if f["name"] == name:
                return f
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON form, valid against the schema."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "revision": self.revision,
            "layout": self.layout,
            "files": self.files,
            "tables": [t.to_dict() for t in self.tables],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically as indented JSON (:func:`dsv41.fileio.atomic_write`: only over a regular
        file or an absent path); VerificationError (a Dsv41Error) when ``path`` cannot be written
        (no temp file is left behind, the old file is untouched)."""

        p = Path(path)
        fileio.atomic_write_json(p, self.to_dict(), "manifest", error=VerificationError)
        self.path = p


_schema_cache: dict[str, Any] = {}


def schema() -> dict[str, Any]:
    """The manifest JSON Schema (parsed once)."""
    if "s" not in _schema_cache:
        _schema_cache["s"] = fileio.loads_json(SCHEMA_PATH.read_text())
    return _schema_cache["s"]


def manifest_from_dict(doc: Any, where: str = "manifest") -> Manifest:
    """Validate ``doc`` (schema + consistency) and build a :class:`Manifest`.

    Raises VerificationError naming the failing JSON path, or the inconsistency: chunk count
    vs size, a table in a file not listed, duplicate layers, a region outside its file, or an
    identity that does not match the table's parameters.
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    err = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if err is not None:
        loc = "/".join(str(x) for x in err.absolute_path) or "(top)"
        raise VerificationError(f"{where} fails its schema at {loc}: {err.message}")
    files = {}
    for f in doc["files"]:
        if f["name"] in files:
            raise VerificationError(f"{where}: file {f['name']} listed twice")
        want = -(-f["size"] // f["chunk_size"])
        if len(f["chunks"]) != want:
            raise VerificationError(
                f"{where}: file {f['name']} has {len(f['chunks'])} chunk hashes, size {f['size']} "
                f"with chunk_size {f['chunk_size']} needs {want}"
            )
        files[f["name"]] = f
    tables = []
    seen = set()
    for t in doc["tables"]:
        L = t["layer_id"]
        if L in seen:
            raise VerificationError(f"{where}: layer {L} has two tables")
        seen.add(L)
        if t["file"] not in files:
            raise VerificationError(f"{where}: table of layer {L} is in {t['file']}, which is not in files")
        if t["weight_bytes"] + t["scale_bytes"] != t["row_bytes"]:
            raise VerificationError(f"{where}: layer {L}: weight_bytes + scale_bytes != row_bytes")
        size = files[t["file"]]["size"]
        for kind, nb in (("weight", t["weight_bytes"]), ("scale", t["scale_bytes"])):
            end = t[f"{kind}_offset"] + t["rows"] * nb
            if end > size:
                raise VerificationError(
                    f"{where}: layer {L} {kind} region ends at byte {end}, beyond {t['file']} size {size}"
                )
        ident = table_identity(doc["layout"], t)
        if ident != t["identity"]:
            raise VerificationError(
                f"{where}: layer {L} identity {t['identity']} does not match its parameters ({ident})"
            )
        tables.append(TableEntry(**t))
    return Manifest(revision=doc["revision"], layout=doc["layout"], files=list(doc["files"]), tables=tables)


def load_manifest(path: str | os.PathLike) -> Manifest:
    """Read and validate a manifest file.  VerificationError when it is missing, not JSON, fails
    the schema, or is inconsistent (see :func:`manifest_from_dict`)."""

    p = Path(path)
    if not os.path.lexists(p):
        raise VerificationError(f"manifest {p} does not exist")
    doc = fileio.read_json(p, "manifest", error=VerificationError)
    m = manifest_from_dict(doc, f"manifest {p}")
    m.path = p
    return m


def _regular_size(p: Path) -> int:
    """Size of a regular file; VerificationError for a missing file, a directory, FIFO, ..."""
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise VerificationError(f"{p}: file does not exist") from None
    except OSError as exc:
        raise VerificationError(f"{p}: cannot stat: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise VerificationError(f"{p}: not a regular file")
    return st.st_size


def _as_manifest(manifest: Manifest | str | os.PathLike) -> Manifest:
    return manifest if isinstance(manifest, Manifest) else load_manifest(manifest)


def _hash_range(path: Path, offset: int, length: int, buf: bytearray, on_bytes=None) -> tuple[str, int]:
    """sha256 of ``length`` bytes at ``offset`` (fewer if the file ends); returns (hex, bytes read)."""
    h = hashlib.sha256()
    got = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
        mv = memoryview(buf)
        while got < length:
            n = os.preadv(fd, [mv[: min(len(buf), length - got)]], offset + got)
            if n == 0:
                break
            h.update(mv[:n])
            got += n
            if on_bytes is not None:
                on_bytes(n)
    finally:
        os.close(fd)
    return h.hexdigest(), got


def _progress_ctx(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    prog = Progress(
        "verify",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    return prog


#: Format tag of the verify cache file (version 2 keys on ctime and device too; a version-1
#: cache, keyed on size/mtime/inode only, is ignored, so the first run after an upgrade re-hashes).
CACHE_FORMAT = "dsv41-verify-cache/2"
VERIFY_MODES = ("cached", "full")


@dataclass
class VerifyReport:
    """What :func:`verify` did: ``files`` considered (manifest order), ``verified`` (hashed in this
    call), ``cached`` (skipped: the cache entry matched), ``cache_updated`` (cache file written)."""

    files: list[str]
    verified: list[str]
    cached: list[str]
    cache_updated: bool = False


def file_key(path: str | os.PathLike) -> list[int] | None:
    """Cache key of a file: ``[size, mtime_ns, ctime_ns, st_dev, st_ino]``, None if it cannot be
    stat'ed.  ``st_ctime_ns`` is set by the kernel on every write, ``utime``, rename or chmod
    and cannot be set back by a user (``touch -d`` restores mtime, not ctime); ``st_dev`` +
    ``st_ino`` name the file, so a replaced file (new inode) is re-hashed too."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]


def manifest_digest(m: Manifest) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, compact): the cache is valid for
    this manifest content only."""
    return hashlib.sha256(fileio.dumps_json(m.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _load_cache(path: Path, digest: str) -> dict[str, Any]:
    """Cached ``{file: key}`` for this manifest; empty when absent, unreadable, another format
    or another manifest (never an error: a bad cache only costs a re-hash)."""

    try:
        doc = fileio.read_json(path)
    except fileio.FileError:
        return {}
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("manifest_sha256") != digest:
        return {}
    files = doc.get("files")
    return files if isinstance(files, dict) else {}


def _save_cache(path: Path, digest: str, files: dict[str, Any]) -> None:
    """Write the cache atomically (temp file, mode 0600, + rename); VerificationError if it
    cannot be written (the verification result itself stands)."""

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VerificationError(f"cannot write verify cache {path}: {exc.strerror or exc}") from None
    fileio.atomic_write_json(
        path,
        {"format": CACHE_FORMAT, "manifest_sha256": digest, "files": files},
        "verify cache",
        sort_keys=True,
        error=VerificationError,
        mode=0o600,
    )


def verify(
    manifest: Manifest | str | os.PathLike,
    data_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    progress: bool | None = None,
    *,
    only: Any = None,
    cache: str | os.PathLike | None = None,
    mode: str = "cached",
    update_cache: bool = True,
) -> VerifyReport:
    """Check the files of ``manifest`` in ``data_dir`` (default: the manifest's directory):
    existence, size and every chunk's sha256, chunks hashed in parallel by ``workers`` threads
    (default: 2 per CPU, max 32), then every table's rows/offsets against its shard's
    safetensors header (checked as the reference loader checks it; always, cache or not).
    ``progress``: rich bar on stderr (None = only when stderr is a TTY).

    ``only``: file names (an iterable of str) to consider, default all.  ``cache``: path of a
    verify cache (JSON); with ``mode="cached"`` a file whose :func:`file_key` (size, mtime_ns,
    ctime_ns, device, inode) equals its cache entry for this manifest content is not re-hashed;
    ``mode="full"`` re-hashes every file whatever the cache says.  After a successful check the
    cache is rewritten when ``update_cache`` and it changed (docs/engram.md, "Verify cache", says
    what it trusts).  Returns a :class:`VerifyReport`.

    Raises VerificationError naming the file, chunk index and byte range of the first problem
    (and how many more there are): missing file, truncated file, wrong size, sha256 mismatch, a
    malformed header or a table the header places elsewhere; nothing is cached then.  Also for an
    unknown ``mode`` or a name in ``only`` that the manifest does not list.
    """
    if mode not in VERIFY_MODES:
        raise VerificationError(f"verify mode must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    m = _as_manifest(manifest)
    if data_dir is None:
        if m.path is None:
            raise VerificationError("verify needs data_dir for a manifest not loaded from a file")
        data_dir = m.path.parent
    d = Path(data_dir)
    names = [f["name"] for f in m.files]
    if only is not None:
        want = {str(x) for x in only}
        unknown = sorted(want - set(names))
        if unknown:
            raise VerificationError(f"verify: {', '.join(unknown)} not in the manifest's files")
        names = [n for n in names if n in want]
    digest = manifest_digest(m)
    cpath = Path(cache) if cache else None
    old = _load_cache(cpath, digest) if cpath is not None else {}
    keys = {n: file_key(d / n) for n in names}
    todo = [n for n in names if mode == "full" or keys[n] is None or old.get(n) != keys[n]]
    _verify_files(m, d, [f for f in m.files if f["name"] in set(todo)], workers, progress)
    problems = []
    for t in m.tables:
        if t.file in names:
            try:
                check_table_header(d / t.file, t)
            except VerificationError as exc:
                problems.append(str(exc))
    if problems:
        raise VerificationError(_summary(problems))
    # keys read again: a file that changed while it was hashed must not be cached as verified
    after = {n: file_key(d / n) for n in names}
    new = {**old, **{n: after[n] for n in names if after[n] is not None and after[n] == keys[n]}}
    written = False
    if cpath is not None and update_cache and new != old:
        _save_cache(cpath, digest, new)
        written = True
    return VerifyReport(files=names, verified=todo, cached=[n for n in names if n not in todo], cache_updated=written)


def check_table_header(path: str | os.PathLike, t: TableEntry) -> None:
    """The shard at ``path`` has a valid safetensors header (as the reference loader checks it)
    that places table ``t`` exactly where the manifest says (rows, offsets, row geometry).
    VerificationError naming the file, layer and differing fields otherwise."""
    reg = table_regions(path, t.layer_id, t.row_bytes)
    want = {
        "rows": t.rows,
        "weight_offset": t.weight_offset,
        "scale_offset": t.scale_offset,
        "weight_bytes": t.weight_bytes,
        "scale_bytes": t.scale_bytes,
    }
    if reg != want:
        diff = ", ".join(f"{k} {want[k]} vs header {reg[k]}" for k in want if reg[k] != want[k])
        raise VerificationError(f"{t.file}: layer {t.layer_id} table differs from the safetensors header: {diff}")


def _verify_files(
    m: Manifest, d: Path, files: list[dict[str, Any]], workers: int | None, progress: bool | None
) -> None:
    """Sizes and chunk sha256s of ``files`` (records of ``m.files``) in ``d``; VerificationError
    summarising the problems."""
    problems: list[str] = []
    tasks: list[tuple[dict, Path, int]] = []
    for f in files:
        p = d / f["name"]
        try:
            st = os.stat(p)
        except FileNotFoundError:
            problems.append(f"{f['name']}: missing (expected {f['size']} bytes in {d})")
            continue
        except OSError as exc:
            problems.append(f"{f['name']}: cannot stat: {exc.strerror or exc}")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{f['name']}: not a regular file in {d}")
            continue
        size = st.st_size
        cs = f["chunk_size"]
        if size < f["size"]:
            k = size // cs
            problems.append(
                f"{f['name']}: truncated: {size} bytes, manifest says {f['size']}; chunk {k} "
                f"bytes [{k * cs}, {min((k + 1) * cs, f['size'])}) incomplete"
            )
            continue
        if size > f["size"]:
            problems.append(f"{f['name']}: wrong size: {size} bytes, manifest says {f['size']}")
            continue
        tasks.extend((f, p, k) for k in range(len(f["chunks"])))
    if problems:
        raise VerificationError(_summary(problems))
    total = sum(min(f["chunk_size"], f["size"] - k * f["chunk_size"]) for f, _, k in tasks)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    prog = _progress_ctx(show, total)
    # default: 2 threads per core, so one thread's disk wait overlaps another's hashing
    nworkers = max(1, min(workers or min(32, 2 * (os.cpu_count() or 1)), len(tasks) or 1))
    local = threading.local()
    lock = threading.Lock()
    bar = None

    def on_bytes(n: int) -> None:
        if prog is not None:
            with lock:
                prog.update(bar, advance=n)

    def work(task: tuple[dict, Path, int]) -> str | None:
        f, p, k = task
        if not hasattr(local, "buf"):
            local.buf = bytearray(min(_READ_BLOCK, max(f["chunk_size"], 4096)))
        cs = f["chunk_size"]
        start = k * cs
        length = min(cs, f["size"] - start)
        try:
            digest, got = _hash_range(p, start, length, local.buf, on_bytes)
        except OSError as exc:
            return f"{f['name']}: chunk {k} bytes [{start}, {start + length}): read error: {exc.strerror or exc}"
        if got != length:
            return f"{f['name']}: chunk {k} bytes [{start}, {start + length}): file ended after {got} bytes"
        if digest != f["chunks"][k]:
            return (
                f"{f['name']}: chunk {k} bytes [{start}, {start + length}): sha256 {digest[:16]}... "
                f"!= manifest {f['chunks'][k][:16]}..."
            )
        return None

    if prog is not None:
        prog.start()
        bar = prog.add_task("verify", total=total)
    try:
        with ThreadPoolExecutor(nworkers, thread_name_prefix="verify") as ex:
            results = list(ex.map(work, tasks))
    finally:
        if prog is not None:
            prog.stop()
    problems = [r for r in results if r]
    if problems:
        raise VerificationError(_summary(problems))


def _summary(problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return f"verify failed: {problems[0]}{more}"


def build_manifest(
    cfg: Any,
    data_dir: str | os.PathLike,
    files: dict[int, str] | None = None,
    *,
    revision: str,
    chunk_size: int = 32 << 20,
    workers: int | None = None,
) -> Manifest:
    """Build a manifest for existing shards (e.g. the real checkpoint's last two shards).

    ``files`` maps layer id -> shard file name (default: :func:`dsv41.engram.shards.shard_names`).  Reads each
    file's safetensors header for the table offsets, hashes chunks in parallel and the two
    regions sequentially.  VerificationError if a tensor is missing or malformed.
    """
    layout = cfg if isinstance(cfg, EngramLayout) else EngramLayout.from_config(cfg)
    d = Path(data_dir)
    names = files or dict(zip(layout.layer_ids, shard_names(len(layout.layer_ids)), strict=False))
    missing = [L for L in layout.layer_ids if L not in names]
    extra = sorted(set(names) - set(layout.layer_ids))
    if missing or extra:
        raise VerificationError(
            f"shard files must name every Engram layer {layout.layer_ids} exactly once"
            + (f"; missing layer(s) {missing}" if missing else "")
            + (f"; unknown layer(s) {extra}" if extra else "")
        )
    for L, name in names.items():
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise VerificationError(f"shard file of layer {L} must be a plain file name in the data dir, got {name!r}")
    frecs: dict[str, dict[str, Any]] = {}
    tables = []
    buf = bytearray(_READ_BLOCK)
    for li, layer in enumerate(layout.layer_ids):
        name = names[layer]
        p = d / name
        reg = table_regions(p, layer, layout.row_bytes)
        if name not in frecs:
            size = _regular_size(p)
            nch = -(-size // chunk_size)

            def one(k: int, p=p, size=size) -> str:
                return _hash_range(p, k * chunk_size, min(chunk_size, size - k * chunk_size), bytearray(_READ_BLOCK))[0]

            with ThreadPoolExecutor(max(1, workers or os.cpu_count() or 1)) as ex:
                chunks = list(ex.map(one, range(nch)))
            whole, _ = _hash_range(p, 0, size, buf)
            frecs[name] = {"name": name, "size": size, "sha256": whole, "chunk_size": chunk_size, "chunks": chunks}
        wsha, _ = _hash_range(p, reg["weight_offset"], reg["rows"] * reg["weight_bytes"], buf)
        ssha, _ = _hash_range(p, reg["scale_offset"], reg["rows"] * reg["scale_bytes"], buf)
        tables.append(
            make_table_entry(layout, li, name, reg["rows"], reg["weight_offset"], reg["scale_offset"], wsha, ssha)
        )
    man = Manifest(revision=revision, layout=layout_params(layout), files=list(frecs.values()), tables=tables)
    manifest_from_dict(man.to_dict(), "built manifest")  # self-check against the schema
    return man
