"""Reading input files and writing output files: the one implementation every reader and writer uses.

Ground floor (stdlib and :mod:`dsv41.errors` only), so the table server, the engine, the harness
and the Ansible modules (which call the package) share it.

Rules (docs/operations.md "Command-line values, input files and output files"):

* **Inputs** must be regular files (a symlink to one is fine). A FIFO, socket, character or block
  device or a directory is refused with one line *before* it is opened, and the open itself is
  ``O_NONBLOCK`` so a FIFO swapped in between the check and the open cannot hang the reader
  either. A file that changes while it is read (device, inode, size or mtime differ between the
  check before and after the read) is refused: its contents are no one version of the file.
* **Outputs** are written atomically (a temporary file in the same directory, fsync, rename) and
  only over a regular file or an absent path. A symlink is refused unless the caller says
  ``follow_symlinks=True`` (or ``dsv41 --follow-symlinks`` set :data:`FOLLOW_SYMLINKS`; then its
  target, which must itself be regular or absent, is replaced); a FIFO, socket, device or directory at the path is refused, and left as it was.
  A failed write (ENOSPC, EDQUOT, EIO, ...) removes the temporary file: no partial or empty file
  is left behind and the previous file, if any, is untouched. The new file keeps the old file's
  permission bits (``0o666 & ~umask`` when there was none), as ``open(path, "w")`` would, unless
  the caller gives ``mode``.
* **stdout** is handled where every command ends, in :func:`dsv41.errors.run_app`: EPIPE (the
  reader went away) and ENOSPC (stdout is a full disk or ``/dev/full``) give one line, exit 1.

Every failure raises :class:`FileError` (a :class:`~dsv41.errors.Dsv41Error`, exit 1), or the
caller's own ``error`` class (a Dsv41Error subclass, so callers keep their exception types), whose
message names what and where, e.g. ``cannot read manifest /tmp/p: it is a FIFO, not a regular
file``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from dsv41.errors import Dsv41Error, os_reason

PathLike = str | os.PathLike


class FileError(Dsv41Error):
    """An input or output path is not usable: wrong file type, changed while read, or a write failed."""


ErrorType = "type[Dsv41Error] | None"  # the exception class to raise (default FileError)

# Set by ``dsv41 --follow-symlinks`` (cli.py): outputs named by a symlink replace its target.
FOLLOW_SYMLINKS = False


def _label(path: PathLike, what: str | None) -> str:
    return f"{what} {os.fsdecode(path)}" if what else os.fsdecode(path)


def kind(mode: int) -> str:
    """The file type of ``st_mode`` in words: ``a FIFO``, ``a directory``, ``a character device``..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def _reason(exc: OSError) -> str:
    return os_reason(exc)


# ---- inputs ---------------------------------------------------------------------------------------

def check_input(path: PathLike, what: str | None = None, *, error: ErrorType = None) -> os.stat_result:
    """Stat ``path`` (following symlinks) and refuse anything but a regular file.

    Returns the ``os.stat_result``. Raises :class:`FileError`: does not exist (a dangling symlink
    included), is a directory / FIFO / socket / device, or cannot be stat'ed. Never opens the path.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        dangling = os.path.lexists(path)
        raise (error or FileError)(f"cannot read {_label(path, what)}: does not exist"
                                   + (" (dangling symlink)" if dangling else "")) from None
    except OSError as exc:
        raise (error or FileError)(f"cannot read {_label(path, what)}: {_reason(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise (error or FileError)(f"cannot read {_label(path, what)}: it is {kind(st.st_mode)}, not a regular file")
    return st


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


@contextlib.contextmanager
def open_input(path: PathLike, what: str | None = None, *, error: ErrorType = None) -> Iterator[BinaryIO]:
    """Open a regular file for reading (binary) and check on exit that it did not change.

    Yields a buffered binary file. Stat first (:func:`check_input`), then ``O_RDONLY | O_NONBLOCK
    | O_NOCTTY`` (a FIFO put in place after the stat cannot block the open), ``fstat`` the open
    file (it must be the file that was checked), and on a normal exit compare device, inode, size
    and mtime (ns) of the file and of the path with the first stat. Raises :class:`FileError`.
    """
    before = check_input(path, what, error=error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise (error or FileError)(f"cannot read {_label(path, what)}: {_reason(exc)}") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or not _same(before, opened):
            raise (error or FileError)(f"cannot read {_label(path, what)}: it was replaced while it was opened; "
                                       "try again")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        try:
            yield f
        except OSError as exc:
            raise (error or FileError)(f"cannot read {_label(path, what)}: {_reason(exc)}") from None
        after = os.fstat(f.fileno())
    try:
        now = os.stat(path)
    except OSError:
        now = None
    if not _same(before, after) or now is None or not _same(before, now):
        raise (error or FileError)(f"cannot read {_label(path, what)}: it changed while it was read (size, mtime or inode "
                                   "differ); read it again when it is complete")


def read_bytes(path: PathLike, what: str | None = None, *, max_bytes: int | None = None,
               error: ErrorType = None) -> bytes:
    """The whole content of a regular file (rules of :func:`open_input`); ``max_bytes`` bounds it.

    Raises :class:`FileError` (also when the file is larger than ``max_bytes``).
    """
    with open_input(path, what, error=error) as f:
        if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
            raise (error or FileError)(f"cannot read {_label(path, what)}: larger than {max_bytes} bytes")
        return f.read()


def read_text(path: PathLike, what: str | None = None, *, encoding: str = "utf-8",
              max_bytes: int | None = None, error: ErrorType = None) -> str:
    """A regular file decoded as ``encoding``; undecodable bytes raise :class:`FileError`
    (``cannot read it: not UTF-8 text at byte N``)."""
    raw = read_bytes(path, what, max_bytes=max_bytes, error=error)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise (error or FileError)(f"cannot read {_label(path, what)}: not {encoding.upper()} text "
                                   f"(byte {exc.start})") from None


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259 section 6 has no NaN or infinities)")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _refused(message: str) -> json.JSONDecodeError:
    exc = json.JSONDecodeError(message, "", 0)
    exc.args = (message,)  # no "line 1 column 1": the position is not known
    return exc


def loads_json(text: str | bytes, *, finite: bool = True) -> Any:
    """``json.loads`` for what the project reads from files, subprocesses and peers, strict.

    Refused, each as :class:`json.JSONDecodeError` (a ``ValueError``, what every caller of
    ``json.loads`` already catches): ``NaN``/``Infinity``/``-Infinity`` (Python's extension; not
    JSON, RFC 8259 section 6; a NaN passes every range check after it), a key given twice in one
    object (RFC 8259 section 4: names "SHOULD be unique"; Python keeps the last silently, so two
    readers of one file could disagree), and nesting deep enough to hit Python's recursion limit
    (``RecursionError`` is no ``ValueError`` and printed a traceback). The parsed value otherwise.
    ``finite=False`` reads ``NaN``/``Infinity`` as floats: only for records the package wrote
    before :func:`dumps_json` (a window decision's open CI was ``[-1.0, Infinity]``; it is
    now ``[-1.0, null]`` with the reason under ``nonfinite``).
    """
    try:
        return json.loads(text, object_pairs_hook=_pairs, **({"parse_constant": _constant} if finite else {}))
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise _refused("nested too deeply (Python's recursion limit)") from None
    except ValueError as exc:  # _constant, _pairs, an integer past sys.get_int_max_str_digits()
        raise _refused(str(exc)) from None


class EncodeError(Dsv41Error, ValueError):
    """A value cannot be written as JSON: a non-finite float where the writer refuses them, or an
    object ``json`` cannot encode. A ``ValueError`` too (what ``json.dumps`` raised before)."""


#: The key under which ``dumps_json(..., nonfinite="null")`` records what each ``null`` stood for.
NONFINITE_KEY = "nonfinite"


def _pointer(path: tuple) -> str:
    # RFC 6901 JSON Pointer: "~" -> "~0", "/" -> "~1"
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path) or "/"


def _nonfinite_name(x: float) -> str:
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


def _finite_copy(obj: Any, path: tuple, found: dict[str, str]) -> Any:
    """``obj`` with every non-finite float (``float`` and its subclasses, numpy's float64) in dicts,
    lists and tuples replaced by None, each recorded in ``found`` as ``{pointer: "nan"|"inf"|"-inf"}``."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        found[_pointer(path)] = _nonfinite_name(obj)
        return None
    if isinstance(obj, dict):
        return {k: _finite_copy(v, (*path, k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_copy(v, (*path, i), found) for i, v in enumerate(obj)]
    return obj


def dumps_json(obj: Any, *, nonfinite: str = "refuse", indent: int | str | None = None, sort_keys: bool = False,
               separators: tuple[str, str] | None = None, ensure_ascii: bool = True, default: Any = None,
               cls: type[json.JSONEncoder] | None = None, what: str | None = None) -> str:
    """``json.dumps`` for everything the project writes (files, stdout, peers, digests), never with
    ``NaN``/``Infinity`` in it (``allow_nan=False`` always).

    Python's ``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default: not JSON
    (RFC 8259 section 6), refused by :func:`loads_json`, by ``jq`` and by most other readers, so a
    record holding one could not be read back. What a non-finite value becomes is the writer's
    choice, given as ``nonfinite``:

    * ``"refuse"`` (default): raise :class:`EncodeError` naming the value's JSON Pointer (RFC 6901),
      e.g. ``cannot write window decision: /ci/0 is -inf, not a JSON number``. For canonical bytes
      and digests (manifests, promotion packages, the journal), requests to peers, and documents
      that cannot hold one.
    * ``"null"``: for measurement records (a window's decision, bench and drill reports, status
      facts, scraped metrics), where a measurement that has no finite value (a CI nothing bounds, a
      ratio over zero, a scraped ``NaN``) must not cost the record: each such float is written as
      ``null`` and the reason is recorded in the document, under :data:`NONFINITE_KEY` of the top
      object: ``{"nonfinite": {"/decision/ci/0": "-inf", ...}}`` (the pointers into the document as
      written; a document that already has that key is refused rather than overwritten). A document
      that is not a JSON object has no place for the reason and is refused as with ``"refuse"``.

    The other arguments are ``json.dumps``'s. Raises :class:`EncodeError` (also for an object
    ``json`` cannot encode: ``TypeError`` in ``json.dumps``) and ``ValueError`` for an unknown
    ``nonfinite``. Non-finite floats produced by ``default``/``cls`` are refused in either mode.
    """
    if nonfinite not in ("refuse", "null"):
        raise ValueError(f"nonfinite must be 'refuse' or 'null', got {nonfinite!r}")
    label = f"cannot write {what}" if what else "cannot write JSON"
    found: dict[str, str] = {}
    doc = _finite_copy(obj, (), found) if nonfinite == "null" else obj
    if found:
        if not isinstance(doc, dict) or NONFINITE_KEY in doc:
            where = ("it is not a JSON object" if not isinstance(doc, dict)
                     else f"it already has a {NONFINITE_KEY!r} key")
            raise EncodeError(f"{label}: {', '.join(f'{p} is {v}' for p, v in found.items())}, not a JSON number, "
                              f"and the reason cannot be recorded ({where})")
        doc = {**doc, NONFINITE_KEY: found}
    try:
        return json.dumps(doc, indent=indent, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii,
                          default=default, cls=cls, allow_nan=False)
    except ValueError as exc:  # a non-finite float (allow_nan=False) or a circular reference
        bad: dict[str, str] = {}
        with contextlib.suppress(RecursionError):
            _finite_copy(doc, (), bad)
        if not bad:  # made by default/cls, or a circular reference: json's own words
            raise EncodeError(f"{label}: {exc}") from None
        raise EncodeError(f"{label}: {', '.join(f'{p} is {v}' for p, v in bad.items())}, not a JSON number "
                          "(RFC 8259 section 6)") from None
    except (TypeError, RecursionError) as exc:
        raise EncodeError(f"{label}: {exc}") from None


def loads_yaml(text: str) -> Any:
    """``yaml.safe_load`` for what the project reads (candidates, role defaults), strict like
    :func:`loads_json`.

    Refused, each as ``yaml.YAMLError`` (what callers of ``safe_load`` already catch), with the
    line: a key given twice in one mapping (YAML 1.2 section 3.2.1.1: keys are unique; PyYAML
    keeps the last silently, so ``min_effect: 0.05`` then ``min_effect: 0.5`` judged with 0.5),
    ``.nan``/``.inf`` floats (JSON Schema's ``minimum``/``maximum`` pass a NaN: a candidate with
    ``min_effect: .nan`` validated and printed ``NaN``, which is not JSON), and nesting past
    Python's recursion limit. Aliases construct shared objects (no expansion), as in safe_load.
    """
    import math

    import yaml

    class _Strict(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:  # unhashable: SafeLoader's own error names it
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found key {key!r} twice in one mapping", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_float(self, node):
            value = super().construct_yaml_float(node)
            if not math.isfinite(value):
                raise yaml.constructor.ConstructorError(
                    None, None, f"{node.value!r} is not a finite number", node.start_mark)
            return value

    _Strict.add_constructor("tag:yaml.org,2002:float", _Strict.construct_yaml_float)
    try:
        return yaml.load(text, Loader=_Strict)  # noqa: S506 - _Strict is a SafeLoader
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (Python's recursion limit)") from None


def read_json(path: PathLike, what: str | None = None, *, max_bytes: int | None = None,
              error: ErrorType = None) -> Any:
    """A regular file parsed as JSON (:func:`loads_json`, strict); bad JSON raises
    :class:`FileError` naming line and column, or what was refused."""
    text = read_text(path, what, max_bytes=max_bytes, error=error)
    try:
        return loads_json(text)
    except ValueError as exc:
        raise (error or FileError)(f"{_label(path, what)} is not JSON (not valid JSON: {exc})") from None


# ---- outputs --------------------------------------------------------------------------------------

def check_output(path: PathLike, what: str | None = None, *, follow_symlinks: bool | None = None,
                 error: ErrorType = None) -> Path:
    """Refuse an output path that is not a regular file or absent; return the path to replace.

    A symlink is refused unless ``follow_symlinks`` (then the resolved target is returned and
    checked the same way). The parent directory must exist. Raises :class:`FileError`.
    """
    p = Path(os.fsdecode(path))
    if follow_symlinks is None:
        follow_symlinks = FOLLOW_SYMLINKS
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise (error or FileError)(f"cannot write {_label(path, what)}: {_reason(exc)}") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        if not follow_symlinks:
            raise (error or FileError)(f"cannot write {_label(path, what)}: it is a symlink; refusing to replace it "
                                       "(remove it, give the real path, or dsv41 --follow-symlinks)")
        return check_output(p.resolve(), what, follow_symlinks=False, error=error)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise (error or FileError)(f"cannot write {_label(path, what)}: it is {kind(st.st_mode)}; refusing to write "
                                   "over it (only a regular file or an absent path is replaced)")
    parent = p.parent
    if not parent.is_dir():
        raise (error or FileError)(f"cannot write {_label(path, what)}: its directory {parent} does not exist")
    return p


def _umask() -> int:
    # /proc first: os.umask() can only be read by setting it, which races other threads' creates
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        return 0o666 & ~_umask()


class Staged:
    """An output written to a temporary file beside its path, not yet in place.

    ``commit()`` renames it over the path (re-checking the path first); ``discard()`` removes it.
    Used where other state must change together with the file (a window's decision and its
    two-window cap, python/dsv41/harness/window_run.py).
    """

    def __init__(self, target: Path, tmp: str, label: str, error: ErrorType = None) -> None:
        self.target, self.tmp, self.label, self.error, self.done = target, tmp, label, error, False

    def commit(self) -> Path:
        """Rename the staged file over the target (checked again: it may have become a FIFO since);
        raises :class:`FileError` (or the caller's ``error`` class), the staged file removed."""
        error = self.error
        try:
            check_output(self.target, None, follow_symlinks=False, error=error)
            os.replace(self.tmp, self.target)
        except Dsv41Error:
            self.discard()
            raise
        except OSError as exc:
            self.discard()
            raise (error or FileError)(f"cannot write {self.label}: {_reason(exc)}") from None
        self.done = True
        _fsync_dir(self.target.parent)
        return self.target

    def discard(self) -> None:
        """Remove the staged file (idempotent)."""
        if not self.done:
            self.done = True
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temp_beside(path: PathLike, what: str | None, follow_symlinks: bool | None,
                 error: ErrorType) -> tuple[Staged, int]:
    """A new temporary file beside ``path`` (checked by :func:`check_output`): its :class:`Staged`
    and open fd. Raises :class:`FileError` (or ``error``) when it cannot be created."""
    label = _label(path, what)
    target = check_output(path, what, follow_symlinks=follow_symlinks, error=error)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:64]}.", suffix=".tmp")
    except OSError as exc:
        raise (error or FileError)(f"cannot write {label}: {_reason(exc)}") from None
    return Staged(target, tmp, label, error), fd


@contextlib.contextmanager
def _filled(staged: Staged, mode: int | None) -> Iterator[None]:
    """Around filling ``staged``: then set its mode (``mode``, else the old file's, else
    ``0o666 & ~umask``); on any failure remove it, an OSError raised as one FileError line."""
    try:
        yield
        os.chmod(staged.tmp, _mode_for(staged.target) if mode is None else mode)
    except OSError as exc:
        staged.discard()
        raise (staged.error or FileError)(f"cannot write {staged.label}: {_reason(exc)}; nothing was written") from None
    except BaseException:
        staged.discard()
        raise


def stage(path: PathLike, fill: Callable[[BinaryIO], None] | bytes | str, what: str | None = None, *,
          follow_symlinks: bool | None = None, error: ErrorType = None, mode: int | None = None) -> Staged:
    """Write ``fill`` (bytes, str as UTF-8, or a callable given the binary file) to a temporary file
    beside ``path`` and fsync it; returns the :class:`Staged` file (not in place yet).

    ``follow_symlinks``: None takes :data:`FOLLOW_SYMLINKS`; ``error``: the Dsv41Error subclass to
    raise; ``mode``: permission bits of the new file (default: the old file's, else
    ``0o666 & ~umask``).

    Raises :class:`FileError` with the temporary file removed when the path is not writable
    (rules of :func:`check_output`) or the write fails (ENOSPC...).
    """
    staged, fd = _temp_beside(path, what, follow_symlinks, error)
    with _filled(staged, mode):
        with os.fdopen(fd, "wb") as f:
            if callable(fill):
                fill(f)
            else:
                f.write(fill.encode("utf-8") if isinstance(fill, str) else fill)
            f.flush()
            os.fsync(f.fileno())
    return staged


def atomic_write(path: PathLike, fill: Callable[[BinaryIO], None] | bytes | str, what: str | None = None, *,
                 follow_symlinks: bool | None = None, error: ErrorType = None, mode: int | None = None) -> Path:
    """Replace ``path`` atomically with ``fill`` (see :func:`stage`); returns the path written.

    Only a regular file or an absent path is replaced; on any failure the old file is untouched and
    no temporary file is left. Raises :class:`FileError`.
    """
    return stage(path, fill, what, follow_symlinks=follow_symlinks, error=error, mode=mode).commit()


def atomic_write_json(path: PathLike, doc: Any, what: str | None = None, *, indent: int | None = 1,
                      sort_keys: bool = False, follow_symlinks: bool | None = None, default: Any = None,
                      error: ErrorType = None, mode: int | None = None, nonfinite: str = "refuse") -> Path:
    """:func:`atomic_write` of :func:`dumps_json` of ``doc`` plus a newline (serialised before
    anything is opened; ``nonfinite`` as there, so a refused value leaves the old file as it was).
    A refused value raises the caller's ``error`` class when given, else :class:`EncodeError`."""
    try:
        text = dumps_json(doc, indent=indent, sort_keys=sort_keys, default=default, nonfinite=nonfinite,
                          what=_label(path, what)) + "\n"
    except EncodeError as exc:
        if error is None:
            raise
        raise error(str(exc)) from None
    return atomic_write(path, text, what, follow_symlinks=follow_symlinks, error=error, mode=mode)


@contextlib.contextmanager
def atomic_path(path: PathLike, what: str | None = None, *, follow_symlinks: bool | None = None,
                error: ErrorType = None, mode: int | None = None) -> Iterator[Path]:
    """For writers that need a file name (``safetensors.save_file``, tar): yields a temporary path
    beside ``path``; on a normal exit it is fsynced and renamed over ``path``, on an exception (or a
    write error) removed. Raises :class:`FileError`."""
    staged, fd = _temp_beside(path, what, follow_symlinks, error)
    os.close(fd)
    with _filled(staged, mode):
        yield Path(staged.tmp)
        fd = os.open(staged.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    staged.commit()


def append(path: PathLike, data: bytes | str, what: str | None = None, *, fsync: bool = True,
           error: ErrorType = None) -> None:
    """Append ``data`` to a log-like file (a journal, ``cells.jsonl``), creating it (mode
    ``0o644 & ~umask``) when absent; all of it or nothing.

    Only a regular file or an absent path (never a symlink, FIFO, device or directory:
    ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``). A failed or short write (ENOSPC...) truncates the
    file back to its size before the call, so no torn record is left. Raises :class:`FileError`.
    """
    label = _label(path, what)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    check_output(path, what, follow_symlinks=False, error=error)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        raise (error or FileError)(f"cannot write {label}: {_reason(exc)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise (error or FileError)(f"cannot write {label}: it is {kind(st.st_mode)}, not a regular file")
        size = st.st_size
        try:
            view = memoryview(raw)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if fsync:
                os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise (error or FileError)(f"cannot write {label}: {_reason(exc)}; nothing was appended") from None
    finally:
        os.close(fd)


class Appender:
    """A file-like ``write``/``flush`` over :func:`append`: each ``write`` is one whole record
    (all or nothing); for a loop that appends records as they come (``cells.jsonl``)."""

    def __init__(self, path: PathLike, what: str | None = None, *, fsync: bool = False,
                 error: ErrorType = None) -> None:
        check_output(path, what, follow_symlinks=False, error=error)
        self.path, self.what, self.fsync, self.error = path, what, fsync, error

    def write(self, data: bytes | str) -> int:
        """Append ``data`` whole; returns its length. Raises :class:`FileError`."""
        append(self.path, data, self.what, fsync=self.fsync, error=self.error)
        return len(data)

    def flush(self) -> None:
        """Nothing to do: every ``write`` is already in the file."""

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
