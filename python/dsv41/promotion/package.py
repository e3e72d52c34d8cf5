"""Promotion packages: one complete production configuration, content-addressed and immutable.

On disk (the controller's ``packages/``, and each host's ``/opt/dsv41/packages``)::

    <root>/<id>/package.json                 the record (schemas/package.schema.json)
    <root>/<id>/files/<host>/<abs path>      the bytes of every managed file of every host
    <root>/<id>/refs/greedy_refs.json        the greedy reference file the package was verified with
    <root>/<id>.tar.gz                       the same directory as one reproducible tarball

The package id is the sha256 (hex, 64 characters) of the canonical JSON of ``package.json``:
``json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` encoded as UTF-8
(RFC 8785-style key ordering; every value here is a string, an integer, a boolean or null, so no
float formatting question arises). Every file is pinned in the record by its own sha256, so the
id covers every byte. Nothing time-dependent is part of the record: the same production always
gets the same id (when and by whom it was recorded lives in the journal and the hosts' history).
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error, VerificationError

SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "package.schema.json"
ID_RE = re.compile(r"^[0-9a-f]{64}$")


class PackageError(Dsv41Error):
    """Bad package input: an unknown or malformed id, a record that fails its schema."""


def canonical(doc: dict) -> bytes:
    """The canonical bytes of a package record (the id is their sha256)."""
    return fileio.dumps_json(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def package_id(doc: dict) -> str:
    """sha256 hex of :func:`canonical` ``(doc)``."""
    return hashlib.sha256(canonical(doc)).hexdigest()


def sha256_bytes(data: bytes) -> str:
    """sha256 hex of ``data``."""
    return hashlib.sha256(data).hexdigest()


def validate(doc) -> None:
    """Validate ``doc`` against schemas/package.schema.json (JSON Schema 2020-12).

    Raises PackageError naming the JSON path of the best-matching error."""
    import jsonschema

    schema = fileio.loads_json(SCHEMA.read_text())
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if err is not None:
        loc = "/".join(str(x) for x in err.absolute_path) or "(top)"
        raise PackageError(f"package.json fails its schema at {loc}: {err.message}")


def check_id(pkg_id: str) -> str:
    """``pkg_id`` when it is 64 lowercase hex characters; PackageError otherwise."""
    if not isinstance(pkg_id, str) or not ID_RE.match(pkg_id):
        raise PackageError(f"not a package id (64 hex characters): {pkg_id!r}")
    return pkg_id


def _rel(host: str, path: str) -> Path:
    """Where the bytes of ``path`` of ``host`` live inside a package directory."""
    if not path.startswith("/") or "\x00" in path or any(p in ("..", ".") for p in Path(path).parts):
        raise PackageError(f"{host}: managed file path must be absolute and plain, got {path!r}")
    return Path("files") / host / path.lstrip("/")


KV_RE = re.compile(rb"--kv-cache-tokens[ =](\d+)")


def kv_budget_from(files: dict) -> int | None:
    """The KV budget (tokens) a host's service definitions launch the engine with: the first
    ``--kv-cache-tokens N`` in the managed files' bytes (``{path: {"content": bytes}}``, sorted by
    path); None where no file names one (hosts without an engine)."""
    for _, f in sorted(files.items()):
        m = KV_RE.search(f["content"])
        if m:
            return int(m.group(1))
    return None


def build(hosts: dict, provenance: dict, refs: bytes | None) -> tuple[dict, dict[str, bytes]]:
    """Make a package record and its blobs from what the hosts run.

    ``hosts``: ``{host: {"groups": [str], "rank": int|None, "dsv41": str|None, "image": ...,
    "manifest": dict|None, "drafter": dict|None, "kv_budget": int|None, "services": [str],
    "files": {abs path: {"content": bytes, "mode": "0644"}}}}``. ``provenance``: see the schema
    (``op``, ``parent``, candidate/window/verdict/force/reason/component). ``refs``: the greedy
    reference file's bytes (None where there is none).

    Returns ``(doc, blobs)`` with ``blobs[relative path inside the package] = bytes``. Raises
    PackageError when the result fails the schema."""
    doc_hosts: dict = {}
    blobs: dict[str, bytes] = {}
    for host, h in sorted(hosts.items()):
        files = {}
        for path, f in sorted(h.get("files", {}).items()):
            data = f["content"]
            files[path] = {"sha256": sha256_bytes(data), "size": len(data), "mode": str(f.get("mode") or "0644")}
            blobs[str(_rel(host, path))] = data
        entry = {
            k: h.get(k)
            for k in ("groups", "rank", "dsv41", "image", "engine_config", "manifest", "drafter", "kv_budget")
        }
        entry["groups"] = sorted(entry["groups"] or [])
        if entry["kv_budget"] is None:
            entry["kv_budget"] = kv_budget_from(h.get("files", {}))
        entry["services"] = sorted(h.get("services") or [])
        entry["files"] = files
        doc_hosts[host] = entry
    prov = {"op": provenance["op"], "parent": provenance.get("parent")}
    for k in ("candidate", "window", "verdict", "reason", "component"):
        prov[k] = provenance.get(k)
    prov["force"] = bool(provenance.get("force", False))
    doc = {
        "format": 1,
        "provenance": prov,
        "hosts": doc_hosts,
        "greedy_refs": None if refs is None else {"sha256": sha256_bytes(refs), "size": len(refs)},
    }
    if refs is not None:
        blobs["refs/greedy_refs.json"] = refs
    validate(doc)
    return doc, blobs


def same_production(root: str | os.PathLike, doc: dict) -> str | None:
    """The id of the stored package ``doc["provenance"]["parent"]`` when it records exactly what
    ``doc`` does (every host's files with sha256, size and mode, facts and services, and the greedy
    references); None when there is no parent or it differs.

    A window's snapshot (provenance op ``window``) or a deploy (op ``deploy``) of an undrifted
    production is production's own package: recording it must not create a second package that
    differs only in provenance.
    Raises PackageError when the parent is named but unknown or malformed."""
    parent = (doc.get("provenance") or {}).get("parent")
    if not parent:
        return None
    have = load(root, parent)
    if have["hosts"] == doc["hosts"] and have.get("greedy_refs") == doc.get("greedy_refs"):
        return parent
    return None


def _tarball(pdir: Path, out: Path) -> None:
    """A reproducible ``.tar.gz`` of ``pdir`` (sorted names, mtime 0, root-owned, gzip mtime 0)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(pdir.rglob("*")):
            info = tar.gettarinfo(str(p), arcname=str(Path(pdir.name) / p.relative_to(pdir)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            if p.is_file():
                with p.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)

    def fill(raw) -> None:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            gz.write(buf.getvalue())

    fileio.atomic_write(out, fill, "package tarball", error=PackageError)


def write(root: str | os.PathLike, doc: dict, blobs: dict[str, bytes]) -> tuple[str, bool]:
    """Store a package under ``root/<id>/`` (+ ``root/<id>.tar.gz``); returns ``(id, created)``.

    Immutable: when ``root/<id>`` exists it is verified instead of written (created False), and a
    stored copy that fails verification raises VerificationError rather than being overwritten.
    The directory appears atomically (written to a temporary sibling, then renamed); when writers
    race on one package, one creates it and the others verify it (created False): no raw OS error.
    Raises PackageError (or VerificationError)."""
    validate(doc)
    pid = package_id(doc)
    root = Path(root)
    dest = root / pid
    if dest.exists():
        verify(root, pid)
        if not (root / f"{pid}.tar.gz").is_file():
            _tarball(dest, root / f"{pid}.tar.gz")
        return pid, False
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{pid[:12]}.", dir=root))
    try:
        for rel, data in blobs.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            # fsynced before the directory is renamed into place: a crash cannot leave a package
            # whose id is right and whose files are empty
            fileio.atomic_write(p, data, f"package {pid[:12]} file {rel}", error=PackageError)
        fileio.atomic_write(
            tmp / "package.json", canonical(doc) + b"\n", f"package {pid[:12]} record", error=PackageError
        )
        try:
            os.replace(tmp, dest)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not dest.is_dir():
                raise PackageError(f"cannot store package {pid[:12]} in {root}: {exc.strerror or exc}") from None
            # another writer stored the same package first: ids are content hashes, so it is this one
            shutil.rmtree(tmp, ignore_errors=True)
            verify(root, pid)
            if not (root / f"{pid}.tar.gz").is_file():
                _tarball(dest, root / f"{pid}.tar.gz")
            return pid, False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _tarball(dest, root / f"{pid}.tar.gz")
    verify(root, pid)
    return pid, True


def load(root: str | os.PathLike, pkg_id: str) -> dict:
    """Read and schema-validate ``root/<id>/package.json`` (no file hashing; see :func:`verify`).

    Raises PackageError for a malformed or unknown id (listing the known ones) or a record that is
    not JSON or fails the schema."""
    check_id(pkg_id)
    pdir = Path(root) / pkg_id
    if not (pdir / "package.json").is_file():
        known = known_ids(root)
        raise PackageError(
            f"unknown package {pkg_id} (no {pdir}/package.json); known: {', '.join(k[:12] for k in known) or 'none'}"
        )
    try:
        doc = fileio.loads_json(
            fileio.read_text(pdir / "package.json", f"package {pkg_id}: package.json", error=PackageError)
        )
    except json.JSONDecodeError as exc:
        raise PackageError(f"package {pkg_id}: package.json is not readable JSON: {exc}") from None
    validate(doc)
    return doc


def resolve(root: str | os.PathLike, ref: str) -> str:
    """A full package id from a full id or a unique prefix of at least 8 hex characters."""
    if isinstance(ref, str) and ID_RE.match(ref):
        return ref
    if not isinstance(ref, str) or not re.fullmatch(r"[0-9a-f]{8,63}", ref):
        raise PackageError(f"not a package id or an id prefix of 8+ hex characters: {ref!r}")
    hits = [k for k in known_ids(root) if k.startswith(ref)]
    if len(hits) != 1:
        raise PackageError(f"package id prefix {ref!r} matches {len(hits)} packages under {root}")
    return hits[0]


def known_ids(root: str | os.PathLike) -> list[str]:
    """The ids of the packages stored under ``root`` (sorted)."""
    r = Path(root)
    return sorted(p.name for p in r.iterdir() if ID_RE.match(p.name) and p.is_dir()) if r.is_dir() else []


def verify(root: str | os.PathLike, pkg_id: str) -> dict:
    """Recompute the id and every file's sha256 of ``root/<id>``.

    Returns ``{"id", "hosts": {host: n files}, "files": n, "bytes": n}``. Raises PackageError for
    bad input and VerificationError (one line naming the first mismatch) when the record's
    canonical sha256 is not the id, a file's bytes differ from the record, a file is missing or
    an unrecorded file is present."""
    doc = load(root, pkg_id)
    pdir = Path(root) / pkg_id
    got = package_id(doc)
    if got != pkg_id:
        raise VerificationError(f"package {pkg_id} is tampered: package.json hashes to {got}")
    expected: dict[str, tuple[str, str, str]] = {}
    for host, h in doc["hosts"].items():
        for path, f in h["files"].items():
            expected[str(_rel(host, path))] = (f["sha256"], host, path)
    if doc["greedy_refs"] is not None:
        expected["refs/greedy_refs.json"] = (doc["greedy_refs"]["sha256"], "controller", "greedy references")
    present = {str(p.relative_to(pdir)) for p in pdir.rglob("*") if p.is_file() or p.is_symlink()}
    present.discard("package.json")
    n_bytes = 0
    for rel, (sha, host, path) in sorted(expected.items()):
        p = pdir / rel
        if not p.is_file():
            raise VerificationError(f"package {pkg_id} is tampered: {path} of {host} is missing ({rel})")
        data = fileio.read_bytes(p, f"package {pkg_id}: {rel}", error=VerificationError)
        if sha256_bytes(data) != sha:
            raise VerificationError(
                f"package {pkg_id} is tampered: {path} of {host} has sha256 {sha256_bytes(data)}, the record says {sha}"
            )
        n_bytes += len(data)
    extra = sorted(present - set(expected))
    if extra:
        raise VerificationError(f"package {pkg_id} is tampered: unrecorded file {extra[0]}")
    return {
        "id": pkg_id,
        "hosts": {h: len(v["files"]) for h, v in doc["hosts"].items()},
        "files": len(expected),
        "bytes": n_bytes,
    }


def blob(root: str | os.PathLike, pkg_id: str, host: str, path: str) -> Path:
    """Where the bytes of ``path`` of ``host`` are stored in package ``pkg_id``."""
    return Path(root) / check_id(pkg_id) / _rel(host, path)


def diff(a: dict, b: dict) -> dict:
    """What changes from package record ``a`` to ``b``, per host.

    Returns ``{"hosts": {host: {"added": [path], "removed": [path], "changed": [path],
    "facts": {key: [a value, b value]}}}, "provenance": {key: [a, b]}, "greedy_refs": [a, b]|None}``,
    with hosts that do not change left out. Empty ``hosts`` means the same production."""
    out: dict = {"hosts": {}, "provenance": {}, "greedy_refs": None}
    for host in sorted(set(a["hosts"]) | set(b["hosts"])):
        ha = a["hosts"].get(host, {"files": {}})
        hb = b["hosts"].get(host, {"files": {}})
        fa, fb = ha["files"], hb["files"]
        d = {
            "added": sorted(set(fb) - set(fa)),
            "removed": sorted(set(fa) - set(fb)),
            "changed": sorted(p for p in set(fa) & set(fb) if fa[p] != fb[p]),
            "facts": {},
        }
        for k in sorted((set(ha) | set(hb)) - {"files"}):
            if ha.get(k) != hb.get(k):
                d["facts"][k] = [ha.get(k), hb.get(k)]
        if d["added"] or d["removed"] or d["changed"] or d["facts"]:
            out["hosts"][host] = d
    for k in sorted(set(a["provenance"]) | set(b["provenance"])):
        if a["provenance"].get(k) != b["provenance"].get(k):
            out["provenance"][k] = [a["provenance"].get(k), b["provenance"].get(k)]
    if a.get("greedy_refs") != b.get("greedy_refs"):
        out["greedy_refs"] = [a.get("greedy_refs"), b.get("greedy_refs")]
    return out


def installed_diff(doc: dict, host: str, installed: dict[str, str]) -> dict:
    """Compare a host's installed managed files (``{path: sha256}``, the managed_files listing) with
    the package record: ``{"write": [path], "remove": [path], "same": n}``."""
    files = doc["hosts"].get(host, {}).get("files", {})
    write = sorted(p for p, f in files.items() if installed.get(p) != f["sha256"])
    remove = sorted(p for p in installed if p not in files)
    return {"write": write, "remove": remove, "same": len(files) - len(write)}


def window_verdict(doc: object) -> str | None:
    """The verdict of a window's ``decision.json`` document: its top-level ``verdict``, else
    ``decision.verdict`` (what ``dsv41 window run`` writes: ``{"decision": {"verdict": ...},
    "candidate": ..., ...}``); None when it has neither."""
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("verdict"), str):
        return doc["verdict"]
    inner = doc.get("decision")
    return inner.get("verdict") if isinstance(inner, dict) and isinstance(inner.get("verdict"), str) else None


def check_window(
    windows_dir: str | os.PathLike, window: str | None, force: bool, reason: str | None, candidate: str | None = None
) -> dict:
    """The promotion gate: ``windows/<window>/decision.json`` must decide WIN (:func:`window_verdict`)
    for ``candidate`` (when the decision names its ``candidate``, it must be this one).

    With ``force`` a ``reason`` (non-empty) is required and the verdict (or its absence) is only
    recorded. Returns ``{"window", "verdict", "force", "reason"}``; raises PackageError (one line)
    when the window is missing or unreadable, measured another candidate, did not WIN, or force
    comes without a reason."""
    reason = (reason or "").strip() or None
    if force and not reason:
        raise PackageError('force=true needs reason="..." (it is recorded in the package)')
    verdict = None
    if window:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(window)):
            raise PackageError(f"window id must be a plain name, got {window!r}")
        p = Path(windows_dir) / str(window) / "decision.json"
        try:
            if not os.path.lexists(p):
                raise FileNotFoundError(p)
            # finite=False: decisions written before fileio.dumps_json hold an open CI as Infinity
            doc = fileio.loads_json(
                fileio.read_text(p, f"window {window}'s decision", error=PackageError), finite=False
            )
            verdict = window_verdict(doc)
            measured = doc.get("candidate") if isinstance(doc, dict) else None
            if candidate and isinstance(measured, str) and measured != candidate and not force:
                raise PackageError(
                    f"window {window} measured candidate {measured!r}, not {candidate!r}: refusing to promote"
                )
        except FileNotFoundError:
            if not force:
                raise PackageError(f"window {window}: no decision ({p} is missing); promotion needs a WIN") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            if not force:
                raise PackageError(f"window {window}: {p} is not a readable decision: {exc}") from None
    elif not force:
        raise PackageError('promotion needs window=ID (a window whose decision is WIN) or force=true reason="..."')
    if verdict != "WIN" and not force:
        raise PackageError(
            f"window {window} decided {verdict!r}, not WIN: refusing to promote "
            '(force=true reason="..." overrides, and is recorded)'
        )
    return {"window": window or None, "verdict": verdict, "force": bool(force), "reason": reason}
