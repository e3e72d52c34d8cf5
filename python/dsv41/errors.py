"""Errors the ``dsv41`` command turns into one clear line and exit code 1.

Raise :class:`Dsv41Error` (or a subclass) for any bad input or failed check that an operator
should read as a sentence, never as a traceback.
"""

from __future__ import annotations

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


def _say(line: str) -> None:
    """Print ``line`` to stderr; argument bytes that are not UTF-8 (surrogate-escaped in
    ``sys.argv``) are shown as backslash escapes whatever the stream's error handler is."""
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)


def run_app(app, argv: list[str] | None = None) -> int:
    """Run a typer ``app`` and return its exit code, turning expected failures into one line.

    Usage errors, bad option values and :class:`Dsv41Error` print ``dsv41: error: <message>`` to
    stderr and return 1 (or the error's ``exit_code``); no traceback.  Shared by the ``dsv41``
    command and the standalone, torch-free proxy entry (``python -m dsv41.drafter.proxy_cli``).
    """
    import typer
    from typer._click import exceptions as click_exc  # typer vendors click

    try:
        rv = app(args=argv, standalone_mode=False)
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
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("dsv41: error: interrupted", file=sys.stderr)
        return 130
    return int(rv) if isinstance(rv, int) else 0
