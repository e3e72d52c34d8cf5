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

The JSON and YAML text itself (strict parsing, never-NaN encoding) is :mod:`dsv41.codec`; its names
are re-exported here (``fileio.loads_json``, ``fileio.dumps_json``, ``fileio.loads_yaml``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from dsv41.codec import (
    NONFINITE_KEY as NONFINITE_KEY,
    EncodeError as EncodeError,
    dumps_json as dumps_json,
    loads_json as loads_json,
    loads_yaml as loads_yaml,
)
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
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
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
        raise (error or FileError)(
            f"cannot read {_label(path, what)}: does not exist" + (" (dangling symlink)" if dangling else "")
        ) from None
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
            raise (error or FileError)(
                f"cannot read {_label(path, what)}: it was replaced while it was opened; try again"
            )
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
        raise (error or FileError)(
            f"cannot read {_label(path, what)}: it changed while it was read (size, mtime or inode "
            "differ); read it again when it is complete"
        )


def read_bytes(
    path: PathLike, what: str | None = None, *, max_bytes: int | None = None, error: ErrorType = None
) -> bytes:
    """The whole content of a regular file (rules of :func:`open_input`); ``max_bytes`` bounds it.

    Raises :class:`FileError` (also when the file is larger than ``max_bytes``).
    """
    with open_input(path, what, error=error) as f:
        if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
            raise (error or FileError)(f"cannot read {_label(path, what)}: larger than {max_bytes} bytes")
        return f.read()


def read_text(
    path: PathLike,
    what: str | None = None,
    *,
    encoding: str = "utf-8",
    max_bytes: int | None = None,
    error: ErrorType = None,
) -> str:
    """A regular file decoded as ``encoding``; undecodable bytes raise :class:`FileError`
    (``cannot read it: not UTF-8 text at byte N``)."""
    raw = read_bytes(path, what, max_bytes=max_bytes, error=error)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise (error or FileError)(
            f"cannot read {_label(path, what)}: not {encoding.upper()} text (byte {exc.start})"
        ) from None


def read_json(path: PathLike, what: str | None = None, *, max_bytes: int | None = None, error: ErrorType = None) -> Any:
    """A regular file parsed as JSON (:func:`loads_json`, strict); bad JSON raises
    :class:`FileError` naming line and column, or what was refused."""
    text = read_text(path, what, max_bytes=max_bytes, error=error)
    try:
        return loads_json(text)
    except ValueError as exc:
        raise (error or FileError)(f"{_label(path, what)} is not JSON (not valid JSON: {exc})") from None


# ---- outputs --------------------------------------------------------------------------------------


def check_output(
    path: PathLike, what: str | None = None, *, follow_symlinks: bool | None = None, error: ErrorType = None
) -> Path:
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
            raise (error or FileError)(
                f"cannot write {_label(path, what)}: it is a symlink; refusing to replace it "
                "(remove it, give the real path, or dsv41 --follow-symlinks)"
            )
        return check_output(p.resolve(), what, follow_symlinks=False, error=error)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise (error or FileError)(
            f"cannot write {_label(path, what)}: it is {kind(st.st_mode)}; refusing to write "
            "over it (only a regular file or an absent path is replaced)"
        )
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


def _temp_beside(
    path: PathLike, what: str | None, follow_symlinks: bool | None, error: ErrorType
) -> tuple[Staged, int]:
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


def stage(
    path: PathLike,
    fill: Callable[[BinaryIO], None] | bytes | str,
    what: str | None = None,
    *,
    follow_symlinks: bool | None = None,
    error: ErrorType = None,
    mode: int | None = None,
) -> Staged:
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


def atomic_write(
    path: PathLike,
    fill: Callable[[BinaryIO], None] | bytes | str,
    what: str | None = None,
    *,
    follow_symlinks: bool | None = None,
    error: ErrorType = None,
    mode: int | None = None,
) -> Path:
    """Replace ``path`` atomically with ``fill`` (see :func:`stage`); returns the path written.

    Only a regular file or an absent path is replaced; on any failure the old file is untouched and
    no temporary file is left. Raises :class:`FileError`.
    """
    return stage(path, fill, what, follow_symlinks=follow_symlinks, error=error, mode=mode).commit()


def atomic_write_json(
    path: PathLike,
    doc: Any,
    what: str | None = None,
    *,
    indent: int | None = 1,
    sort_keys: bool = False,
    follow_symlinks: bool | None = None,
    default: Any = None,
    error: ErrorType = None,
    mode: int | None = None,
    nonfinite: str = "refuse",
) -> Path:
    """:func:`atomic_write` of :func:`dumps_json` of ``doc`` plus a newline (serialised before
    anything is opened; ``nonfinite`` as there, so a refused value leaves the old file as it was).
    A refused value raises the caller's ``error`` class when given, else :class:`EncodeError`."""
    try:
        text = (
            dumps_json(
                doc, indent=indent, sort_keys=sort_keys, default=default, nonfinite=nonfinite, what=_label(path, what)
            )
            + "\n"
        )
    except EncodeError as exc:
        if error is None:
            raise
        raise error(str(exc)) from None
    return atomic_write(path, text, what, follow_symlinks=follow_symlinks, error=error, mode=mode)


@contextlib.contextmanager
def atomic_path(
    path: PathLike,
    what: str | None = None,
    *,
    follow_symlinks: bool | None = None,
    error: ErrorType = None,
    mode: int | None = None,
) -> Iterator[Path]:
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


def append(
    path: PathLike, data: bytes | str, what: str | None = None, *, fsync: bool = True, error: ErrorType = None
) -> None:
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

    def __init__(
        self, path: PathLike, what: str | None = None, *, fsync: bool = False, error: ErrorType = None
    ) -> None:
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
