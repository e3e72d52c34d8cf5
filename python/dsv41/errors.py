"""Errors the ``dsv41`` command turns into one clear line and exit code 1.

Raise :class:`Dsv41Error` (or a subclass) for any bad input or failed check that an operator
should read as a sentence, never as a traceback.
"""

from __future__ import annotations

import contextlib
import sys


class Dsv41Error(Exception):
    """A user-facing failure: bad input, a failed verification, an unreachable peer.

    ``str(exc)`` is printed as ``dsv41: error: <message>`` and the command exits with
    ``exit_code`` (default 1).
    """

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(Dsv41Error):
    """A model or deployment configuration is missing keys or is inconsistent."""


class VerificationError(Dsv41Error):
    """Data on disk or on the wire does not match what a manifest or reference says."""


def os_reason(exc: OSError) -> str:
    """An ``OSError`` in words (``no space left on the device``, ``the reader closed the pipe``...)."""
    import errno

    words = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EPIPE: "the reader closed the pipe",
        errno.EIO: "I/O error",
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EFBIG: "file too large",
        errno.ENAMETOOLONG: "file name too long",
        errno.ENOENT: "does not exist",
        errno.ENOTDIR: "a component of the path is not a directory",
        errno.EISDIR: "is a directory",
        errno.ELOOP: "too many levels of symlinks",
        errno.ENXIO: "no such device or address",
    }
    return words.get(exc.errno or 0) or exc.strerror or type(exc).__name__


def os_error_line(exc: OSError) -> str:
    """One line for an ``OSError`` that reached :func:`run_app`: the file (or stdout) and the reason."""
    import errno

    name = exc.filename
    if name is None and (isinstance(exc, BrokenPipeError) or exc.errno in (errno.EPIPE, errno.ENOSPC, errno.EIO)):
        return f"cannot write to stdout: {os_reason(exc)}"
    where = f"{name if isinstance(name, str) else repr(name)}: " if name is not None else ""
    return f"{where}{os_reason(exc)}"


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null after a failed write to it, so the interpreter's exit-time flush
    of what is still buffered cannot print a second error (``Exception ignored ... BrokenPipe``)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class ArgumentError(Dsv41Error):
    """A command-line value is malformed before any command sees it: not UTF-8, empty, too long,
    or a path naming something no command reads or writes (FIFO, socket, device, dangling
    symlink). Exit 2, the usage-error code of argparse and click."""

    exit_code = 2


# Longest value accepted (bytes, UTF-8): PATH_MAX (4096, with its NUL) for paths; 64 KiB for any
# other string, half the kernel's MAX_ARG_STRLEN (131072) - a longer value is a file's job.
MAX_PATH_BYTES = 4095
MAX_VALUE_BYTES = 65536

_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if c != 9} | {0x7F: "\\x7f"}


def one_line(text: str) -> str:
    """``text`` as one printable line: surrogate-escaped argument bytes and control characters
    (newlines included) become backslash escapes, so an error naming a value stays one line."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").translate(_CONTROL)


def _say(line: str) -> None:
    """Print ``line`` to stderr as one line (:func:`one_line`) whatever the stream's error handler."""
    try:
        print(one_line(line), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr itself is gone: nothing left to tell
        pass


def _show(value: str, limit: int = 48) -> str:
    shown = one_line(value[:limit])
    return repr(shown) + ("..." if len(value) > limit else "")


def check_argument(value: str, option: str, *, is_path: bool) -> None:
    """Refuse one command-line value; raises :class:`ArgumentError` naming ``option``.

    Every string value (options and positional arguments, any command) must be UTF-8 (Python
    decodes other argv bytes to lone surrogates, PEP 383), non-empty, free of NUL, and at most
    :data:`MAX_VALUE_BYTES` (:data:`MAX_PATH_BYTES` for a path). A path value must not name a
    FIFO, socket or device (reading one blocks or never ends; writing one is never meant) nor a
    dangling symlink; this looks with ``lstat``/``stat`` only, never opens the path.
    """
    import os
    import stat

    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        shown = value.encode("utf-8", "surrogateescape")
        raise ArgumentError(
            f"{option}: value is not valid UTF-8 at byte {len(value[: exc.start].encode('utf-8'))}: "
            f"{shown[:48]!r}{'...' if len(shown) > 48 else ''}"
        ) from None
    if not raw:
        raise ArgumentError(f"{option}: empty value; give a value or leave the option out")
    if "\x00" in value:
        raise ArgumentError(f"{option}: value contains a NUL byte: {_show(value)}")
    limit = MAX_PATH_BYTES if is_path else MAX_VALUE_BYTES
    if len(raw) > limit:
        raise ArgumentError(f"{option}: value is {len(raw)} bytes, longer than the {limit} accepted: {_show(value)}")
    if not is_path or value == "-":
        return
    try:
        lst = os.lstat(value)
    except OSError:
        return  # absent (or unreachable): the command says what it needs
    try:
        st = os.stat(value)
    except OSError:
        if stat.S_ISLNK(lst.st_mode):
            raise ArgumentError(f"{option}: {_show(value, 200)} is a dangling symlink") from None
        return
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(st.st_mode):
            raise ArgumentError(f"{option}: {_show(value, 200)} is {what}, not a regular file or directory")


def _walk(cmd, path):
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _walk(sub, (*path, name))


def iter_parameters(cmd):
    """Every ``(command path, parameter)`` of a click command tree (typer's ``get_command``),
    groups included; the parameter's ``type_descriptor`` says its annotation and whether it is a
    path. What :func:`guard_arguments` wraps and what tests/unit/test_cli_arguments.py feeds."""
    for path, c in _walk(cmd, ()):
        for p in c.params:
            yield path, p


def option_name(param) -> str:
    """How the command line spells ``param``: its longest ``--option`` or its ``METAVAR``."""
    opts = [o for o in getattr(param, "opts", ()) if o.startswith("-")]
    if opts:
        return max(opts, key=len)
    return (param.metavar or param.name or "ARGUMENT").upper()


def check_finite(value: str, option: str) -> None:
    """Refuse a value of a ``float`` option that reads as NaN or an infinity (``nan``, ``inf``,
    ``-Infinity``, ``1e999``); raises :class:`ArgumentError` naming ``option``.

    Python's ``float()`` accepts them and every comparison with NaN is false, so a NaN slips past
    any ``x < low`` / ``x > high`` check and an infinity past a one-sided one (``--sigma inf`` once
    printed a table of zeros and exited 0). No option of the command means "no limit" by an
    infinity: a limit left out is its ``None`` default. Values that are not numbers at all are left
    to typer's own conversion error.
    """
    import math

    try:
        number = float(value)
    except (ValueError, OverflowError):
        return
    if not math.isfinite(number):
        raise ArgumentError(f"{option}: {_show(value)} is not a finite number")


def guard_arguments(cmd) -> None:
    """Route every value of every parameter of ``cmd`` (a click command tree) through
    :func:`check_argument` before typer converts it, and every value of a ``float`` parameter
    through :func:`check_finite`; defaults are not checked (they are code)."""
    from typer._click.core import ParameterSource

    for path, p in iter_parameters(cmd):
        if getattr(p, "_dsv41_guarded", False):
            continue
        original = p.process_value
        is_path = bool(getattr(getattr(p, "type_descriptor", None), "is_path", False))
        is_float = getattr(getattr(p, "type_descriptor", None), "annotation", None) is float
        where = " ".join(path)
        name = f"{where} {option_name(p)}".strip()

        def process_value(ctx, value, _p=p, _original=original, _is_path=is_path, _is_float=is_float, _name=name):
            if ctx.get_parameter_source(_p.name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(v, str):
                        check_argument(v, _name, is_path=_is_path)
                        if _is_float:
                            check_finite(v, _name)
            return _original(ctx, value)

        p.process_value = process_value
        p._dsv41_guarded = True


class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an exception (:func:`sigterm_unwinds`): a KeyboardInterrupt, so every
    ``finally`` and ``except KeyboardInterrupt`` runs as for Ctrl-C (temporary files removed,
    partial results kept); :func:`run_app` reports it and exits 143 (128 + SIGTERM)."""


# Set by the SIGTERM handler below: typer swallows the exception into a return value of 130, and
# run_app must still say which signal it was.
_SIGTERM_FIRED = {"sigterm": False}


def _raise_terminated(signum, frame):
    """The SIGTERM handler of a ``dsv41`` command: unwind like Ctrl-C (:class:`Terminated`)."""
    _SIGTERM_FIRED["sigterm"] = True
    raise Terminated


def _ours_or_default(handler) -> bool:
    import signal

    return handler == signal.SIG_DFL or handler is _raise_terminated


@contextlib.contextmanager
def sigterm_unwinds():
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread, where its handler
    is still the default one (or already this module's, installed by :func:`signals_from_start`).
    Python's default SIGTERM ends the process without unwinding, so an interrupted write left its
    temporary file behind (``engram make-tables`` killed by a playbook timeout: a 51 MB
    ``.model-00047-of-00048.safetensors.tmpN``). A handler someone installed (a server's drain,
    bench's own) is left alone; the previous handler is restored after. Yields a dict whose
    ``sigterm`` is True once SIGTERM fired."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not _ours_or_default(
        signal.getsignal(signal.SIGTERM)
    ):
        yield {"sigterm": False}
        return
    prev = signal.getsignal(signal.SIGTERM)
    _SIGTERM_FIRED["sigterm"] = False
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield _SIGTERM_FIRED
    finally:
        signal.signal(signal.SIGTERM, prev)


def _interrupted_line(exc: BaseException) -> tuple[str, int]:
    """The one line and exit code of a KeyboardInterrupt (SIGINT: 130) or :class:`Terminated` (143)."""
    if isinstance(exc, Terminated) or _SIGTERM_FIRED["sigterm"]:
        return "dsv41: error: terminated (SIGTERM)", 143
    return "dsv41: error: interrupted", 130


@contextlib.contextmanager
def signals_from_start():
    """For a command's process entry, around everything before :func:`run_app` (importing the
    command groups, building the command tree): SIGTERM unwinds from here on (its handler stays
    installed for :func:`run_app`), and a SIGINT or SIGTERM arriving in the block prints the one
    line and raises ``SystemExit`` 130 or 143 instead of a ``KeyboardInterrupt`` traceback with
    rc -2 or a silent rc -15 (Ctrl-C in a command's first second). Main thread only; a SIGTERM
    handler someone else installed is left alone."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except KeyboardInterrupt as exc:  # Terminated included
        line, code = _interrupted_line(exc)
        _say(line)
        raise SystemExit(code) from None


def quiet_after_exit() -> None:
    """Once a command's process has its exit code: SIGINT and SIGTERM are ignored, so a signal in
    the last instant (the interpreter's shutdown) cannot replace the command's one line and exit
    code by a traceback. Only for a process entry (never in-process callers: tests, pytest)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        h = signal.getsignal(sig)
        if h is signal.default_int_handler or _ours_or_default(h):
            signal.signal(sig, signal.SIG_IGN)


def stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` of a ``dsv41`` command prints every thread's stack to its stderr
    (:func:`faulthandler.register`) and the command goes on: how a command that hangs (a test's
    child, an operator's run) says where it is. Installed only from the main thread and only while
    SIGUSR1 has its default disposition (which would end the process); a handler a command
    installed stays. Never raises: without a real stderr (``sys.__stderr__`` None or no fd) nothing
    is installed."""
    import faulthandler
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL:
        return
    with contextlib.suppress(AttributeError, OSError, ValueError, RuntimeError):
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def run_app(app, argv: list[str] | None = None, *, command=None) -> int:
    """Run a typer ``app`` and return its exit code, turning expected failures into one line.

    Every parameter value first goes through :func:`check_argument` (:func:`guard_arguments`):
    a malformed one exits 2 naming the option. Usage errors, bad option values and
    :class:`Dsv41Error` print ``dsv41: error: <message>`` to stderr and return 1 (or the error's
    ``exit_code``); an ``OSError`` (a closed pipe or a full disk on stdout, a file the command could
    not write) prints one line and returns 1; no traceback. ``command``: the click command tree
    of ``app``, when the caller built it already (tests that run many command lines). Shared by the
    ``dsv41`` command, the standalone torch-free proxy entry (``python -m dsv41.drafter.proxy_cli``)
    and ``python -m dsv41.engram.remote_cli``. SIGUSR1 prints every thread's stack
    (:func:`stacks_on_sigusr1`).

    Signals: SIGTERM unwinds (:func:`sigterm_unwinds`, exit 143); SIGINT raises KeyboardInterrupt
    (exit 130) when the command was started with SIGINT at its default disposition, which is how
    an interactive shell starts a foreground command, so an operator's Ctrl-C works. A SIGINT
    *ignored* by the parent is deliberately kept ignored (Python keeps an inherited ``SIG_IGN``
    and this does not restore it): POSIX shells start the background jobs of a script
    (``dsv41 window run ... &``) with SIGINT and SIGQUIT ignored so that a Ctrl-C at the terminal
    ends the script's foreground work and not its background runs, which share its process group;
    service managers and ``nohup``-style wrappers ignore it on purpose too. Restoring it would let one
    Ctrl-C end every such run. SIGTERM is the way to stop them (``dsv41 window stop-run`` sends it).
    """
    from typer.main import get_command

    try:
        cmd = command if command is not None else get_command(app)
        guard_arguments(cmd)
        stacks_on_sigusr1()
        return _run(cmd, argv)
    except KeyboardInterrupt as exc:  # Terminated too; also one arriving outside _run's own handling
        line, code = _interrupted_line(exc)
        _say(line)
        return code


def _run(cmd, argv) -> int:
    """:func:`run_app`'s body once the command tree is built and guarded."""
    import typer
    from typer._click import exceptions as click_exc  # typer vendors click

    out0, err0 = sys.stdout, sys.stderr
    try:
        with sigterm_unwinds() as fired:
            rv = cmd.main(args=argv, prog_name="dsv41", standalone_mode=False)
        if rv == 130:  # typer's silent Exit(130) for a KeyboardInterrupt (Ctrl-C, or SIGTERM here)
            _say("dsv41: error: terminated (SIGTERM)" if fired["sigterm"] else "dsv41: error: interrupted")
            return 143 if fired["sigterm"] else 130
        sys.stdout.flush()  # a full disk or a closed pipe on stdout is reported here, not at exit
    except SystemExit:
        if sys.stdout is out0:
            raise
        # typer met EPIPE on stdout: it swapped in flush-pacifying wrappers and exits 1 silently
        sys.stdout, sys.stderr = out0, err0
        _say("dsv41: error: cannot write to stdout: the reader closed the pipe")
        _silence_stdout()
        return 1
    except typer.Exit as exc:
        return int(exc.exit_code)
    except click_exc.NoArgsIsHelpError as exc:
        print(exc.format_message(), file=sys.stderr)
        return 0
    except typer.Abort:
        print("dsv41: error: aborted", file=sys.stderr)
        return 1
    except click_exc.ClickException as exc:  # usage errors, bad option values
        _say(f"dsv41: error: {exc.format_message()}")
        return 1
    except Dsv41Error as exc:
        _say(f"dsv41: error: {exc}")
        return exc.exit_code
    except OSError as exc:  # stdout (EPIPE, ENOSPC) or any file the command did not wrap itself
        line = os_error_line(exc)
        _say(f"dsv41: error: {line}")
        if line.startswith("cannot write to stdout"):
            _silence_stdout()
        return 1
    except RecursionError:  # an input nested past Python's recursion limit that a parser did not wrap
        _say("dsv41: error: an input is nested too deeply (Python's recursion limit)")
        return 1
    except KeyboardInterrupt as exc:  # Terminated (SIGTERM) included
        line, code = _interrupted_line(exc)
        _say(line)
        return code
    return int(rv) if isinstance(rv, int) else 0
