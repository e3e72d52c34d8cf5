"""Names are names: the one check for every window, package, candidate and operation id a command
or a playbook takes.

A name is 1-128 characters of ``[A-Za-z0-9._-]``, starts with a letter or digit and is never
``.``/``..``: no glob character (``*?[``), no path component (``/``, ``..``), no whitespace or
control character, so it can be joined to a directory or matched literally and mean one thing.
"""

from __future__ import annotations

import re

from dsv41.errors import Dsv41Error

#: What a name may be.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class NameError_(Dsv41Error):
    """A value that is not a plain name (one line naming what it was for)."""


def check_name(value: object, what: str = "name", error: type[Dsv41Error] = NameError_) -> str:
    """``value`` when it is a plain name (:data:`NAME_RE`, not ``..``); else ``error`` with one
    line naming ``what`` and the value."""
    if isinstance(value, str) and NAME_RE.fullmatch(value) and ".." not in value:
        return value
    raise error(
        f"{what} must be a plain name (1-128 characters of A-Z a-z 0-9 . _ -, starting with a letter or "
        f"digit; no glob, no '/', no '..'), got {value!r}"
    )


def option(what: str, *, many: bool = False, empty_ok: bool = False):
    """A typer/click option callback that refuses a value that is not a plain name (``many``: a
    comma-separated list of them; ``empty_ok``: ``""`` means "not given") with a usage error
    naming the option and ``what``, before the command runs."""

    def check(value):
        import typer

        if value is None or (empty_ok and value == ""):
            return value
        for part in value.split(",") if many else [value]:
            try:
                check_name(part.strip() if many else part, what)
            except NameError_ as exc:
                raise typer.BadParameter(str(exc)) from None
        return value

    return check
