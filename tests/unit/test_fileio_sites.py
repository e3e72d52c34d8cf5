"""Every reader and writer of the package goes through ``dsv41.fileio``: a scan of the package's
source (``ast``) finds every file open and every write, and each one outside fileio is named in an
allow-list below with why (a stale entry fails too); the write classifier is checked on planted
writes. The file types, write failures and commands themselves: test_fileio.py.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from writescan import write_calls

PKG = Path(__file__).resolve().parents[2] / "python" / "dsv41"
REPO = PKG.parents[1]


# ---- every reader and writer goes through fileio --------------------------------------------------

# (module, function) pairs allowed to open files themselves, and why.
ALLOWED = {
    ("fileio", "*"): "the implementation",
    ("authz", "load_secret"): "a secret file: O_NOFOLLOW, fstat S_ISREG and mode 0600 checked before the read",
    (
        "authz",
        "write_secret",
    ): "a secret file created 0600 (O_EXCL temporary, fsync, rename): fileio's temporaries take the umask",
    ("filelock", "acquire"): "the state file's lock file: an flock, nothing written",
    ("drafter.gpulock", "acquire"): "a card's lifetime lock: an flock held (and inherited by rank 1) for the "
    "worker's life, the holder's pid written in place",
    ("drafter.gpulock", "holder_pid"): "reads at most 32 bytes of a held card lock (O_NOFOLLOW) to name its holder",
    ("promotion.oplock", "_open"): "the change lock file: an flock, nothing written",
    ("engram.reader", "open_table_file"): "O_DIRECT shard reads: O_NONBLOCK open, fstat S_ISREG before any read",
    ("engram.manifest", "_hash_range"): "preadv of shard chunks after _regular_size checked the file",
    (
        "engram.synthetic",
        "__init__",
    ): "HashingWriter: shards written to temporary names, checked and renamed by make-tables",
    ("harness.window", "start"): "FaultTrigger's fault.log: the drill command's stdout/stderr descriptor",
    ("harness.drill_faults", "holder"): "the lab's holder pid files (the lab role writes them)",
    ("engram.server", "_is_ready_file"): "called only after p.is_file()",
    (
        "engine.api_router",
        "resume",
    ): "st.open() is ServerState.open (admission opens), no file; the hold file goes through engine.hold",
    ("harness.procident", "*"): "the kernel's process identity: /proc/<pid>/stat and /proc/sys/kernel/random/boot_id",
    ("promotion.package", "_tarball"): "files of a package directory the package itself wrote",
    ("promotion.journal", "append"): "os.open of the journal's directory, to fsync it",
    ("errors", "_silence_stdout"): "opens /dev/null to put under fd 1 after stdout failed",
    ("drafter.model", "save_drafter"): "safetensors.save_file into fileio.atomic_path's temporary path",
    ("engine.weights", "save_weights"): "safetensors.save_file into fileio.atomic_path's temporary path",
    ("drafter.model", "identities"): "safetensors.load_file after fileio.check_input",
    ("drafter.model", "load_model"): "safetensors.load_file after fileio.check_input",
    ("engine.weights", "load_weights"): "safetensors.load_file after fileio.check_input",
}
OPENERS = {
    "open",
    "read_text",
    "read_bytes",
    "write_text",
    "write_bytes",
    "load_file",
    "save_file",
    "fdopen",
    "savefig",
    "tofile",
    "fromfile",
}
# the package's own data files (python/dsv41/schemas, python/dsv41/data), read by constant name
SCHEMAS = ("SCHEMA", "CANDIDATE_SCHEMA", "SCHEMA_PATH", "CONTRACT_PATH", "VLLM_FIELDS_FILE")


def test_no_module_opens_files_except_through_fileio() -> None:
    found, used = [], set()
    for path in sorted(PKG.rglob("*.py")):
        mod = ".".join(path.relative_to(PKG).with_suffix("").parts)
        tree = ast.parse(path.read_text(), str(path))
        # calls inside a function handed to fileio (``atomic_write(p, lambda f: fig.savefig(f, ...))``) write
        # to the file object fileio opened
        inside = {
            id(n)
            for c in ast.walk(tree)
            if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute)
            and isinstance(c.func.value, ast.Name)
            and c.func.value.id == "fileio"
            for a in c.args
            if isinstance(a, ast.Lambda)
            for n in ast.walk(a)
        }
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                if not isinstance(node, ast.Call) or id(node) in inside:
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name not in OPENERS and not (
                    name == "open"
                    or (
                        isinstance(f, ast.Attribute)
                        and f.attr == "open"
                        and isinstance(f.value, ast.Name)
                        and f.value.id == "os"
                    )
                ):
                    continue
                if (
                    isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Name)
                    and f.value.id in ("fileio", "tarfile", "gzip", "mmap")
                ):
                    continue
                src = ast.get_source_segment(path.read_text(), node) or ""
                if any(s in src for s in SCHEMAS) or "/proc/" in src or "sys.argv" in src:
                    continue  # the package's own data files; /proc; a child script's own argument
                key = next((k for k in ((mod, fn.name), (mod, "*")) if k in ALLOWED), None)
                if key is not None:
                    used.add(key)
                    continue
                found.append(f"{mod}.{fn.name}: {src[:80]}")
    assert not found, "file I/O outside dsv41.fileio:\n" + "\n".join(found)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match no file I/O any more (remove them): {stale}"


# ---- every write another process or a later run reads goes through fileio -------------------------

# (module, function's qualified name, kind of write) -> why it may write without fileio.atomic_write.
# Kinds: see write_calls. A stale entry (no such write left) fails too.
WRITE_ALLOWED = {
    ("fileio", "*", "*"): "the implementation",
    ("authz", "write_secret", "os.open"): "a secret created 0600 from the start (O_EXCL temporary, fsync, rename)",
    ("filelock", "acquire", "os.open"): "the lock file of a state file: flock only, never written",
    ("drafter.gpulock", "acquire", "os.open"): "a card lock: the pid is written under the flock, in place (a "
    "rename would leave the lock on the old inode); a reader that sees it half-written names no pid",
    ("promotion.oplock", "_open", "os.open"): "the change lock file: flock only, never written",
    ("engram.synthetic", "HashingWriter.__init__", "open"): "shards streamed (GBs, hashed as written) to temporary "
    "names that make-tables checks and renames into place",
    ("harness.window", "FaultTrigger.start", "open"): "fault.log: the drill command's own stdout/stderr, a log its "
    "child writes as it goes (nothing parses it)",
    ("errors", "_silence_stdout", "os.open"): "/dev/null put under fd 1 after stdout failed",
}


def _package_writes() -> list[tuple[str, str, str, int]]:
    out = []
    for root, prefix in ((PKG, ""), (REPO / "plugins", "plugins.")):
        for path in sorted(root.rglob("*.py")):
            mod = prefix + ".".join(path.relative_to(root).with_suffix("").parts)
            out += write_calls(path.read_text(), mod)
    return out


def _allowed(write: tuple, table: dict) -> tuple | None:
    mod, qual, kind, _ = write
    for key in ((mod, qual, kind), (mod, "*", "*"), (mod, qual, "*")):
        if key in table:
            return key
    return None


def test_every_write_goes_through_atomic_write() -> None:
    """The package's and the modules' files are written by ``fileio`` (atomic: a reader never sees
    a torn, empty or half-written file: run.pid, the fault trigger, a package's blobs); the
    exceptions are in WRITE_ALLOWED with their reason, and every entry still names a write."""
    writes = _package_writes()
    assert len({w[0] for w in writes}) >= 3, writes  # the scan sees the package (fileio itself at least)
    bad = [f"{m}:{ln} {q}: {k}" for m, q, k, ln in writes if _allowed((m, q, k, ln), WRITE_ALLOWED) is None]
    assert not bad, (
        "writes outside dsv41.fileio (use fileio.atomic_write, or add a WRITE_ALLOWED reason):\n" + "\n".join(bad)
    )
    used = {_allowed(w, WRITE_ALLOWED) for w in writes}
    stale = [k for k in WRITE_ALLOWED if k not in used]
    assert not stale, f"WRITE_ALLOWED entries that match no write any more (remove them): {stale}"
    assert all(isinstance(v, str) and v for v in WRITE_ALLOWED.values())


def test_the_write_classifier_on_planted_writes() -> None:
    """Each kind of write is found where it is, reads and writes through fileio are not."""
    src = textwrap.dedent("""
        import json, os, shutil, tarfile, yaml
        from pathlib import Path
        from dsv41 import fileio
        LOG = open("/tmp/x.log", "a")
        def reads(p):
            open(p).read(); open(p, "rb"); Path(p).open(); os.open(p, os.O_RDONLY); json.dumps({})
            tarfile.open(fileobj=p, mode="w"); yaml.safe_dump({})
        def writes(p, mode, d):
            open(p, "w"); open(p, mode=mode); Path(p).open("ab"); Path(p).write_text("x"); Path(p).write_bytes(b"")
            json.dump({}, open(p, "r+")); shutil.copy(p, d); shutil.copytree(p, d); yaml.safe_dump({}, d)
            flags = os.O_WRONLY | os.O_CREAT
            os.open(p, flags)
        class C:
            def m(self, p, fig, tar):
                Path(p).touch(); fig.savefig(p); tar.extractall(p)
        def through(p, fig, w):
            fileio.atomic_write(p, lambda f: fig.savefig(f))
            def fill(f):
                f.write(b"x"); open(p, "w")
            fileio.atomic_write(p, fill)
            with fileio.atomic_path(p) as tmp:
                w.save_file({}, str(tmp))
            w.save_file({}, p)
    """)
    got = [(q, k) for _, q, k, _ in write_calls(src, "m")]
    assert got == [
        ("<module>", "open"),
        ("writes", "open"),
        ("writes", "open"),
        ("writes", "open"),
        ("writes", "write_text"),
        ("writes", "write_bytes"),
        ("writes", "json.dump"),
        ("writes", "open"),
        ("writes", "shutil.copy"),
        ("writes", "shutil.copytree"),
        ("writes", "yaml.safe_dump"),
        ("writes", "os.open"),
        ("C.m", "touch"),
        ("C.m", "savefig"),
        ("C.m", "extract"),
        ("through", "save_file"),
    ], got
    table = {("m", "writes", "open"): "r", ("m", "gone", "open"): "stale"}
    used = {_allowed(w, table) for w in write_calls(src, "m")}
    assert ("m", "writes", "open") in used and ("m", "gone", "open") not in used
