"""The command lines that drive a dsv41 service through the host's service manager, systemd (the
only one: production and the lab; the supervisord lab was retired). Used where Python drives
or reads services (``dsv41 drill``, ``dsv41 status --local``); roles/dsv41_service tasks/control.yml
is the Ansible side of the same job and the names follow it: the manager ``systemd``
(``dsv41_service_manager``), the actions ``start``, ``stop``, ``kill``, and the states as systemd's
ActiveState says them (``active``, ``inactive``, ``failed``, ``activating``, ...).

Every builder returns an argv list (no shell); the caller runs it where the service lives (on the
host itself, or ``nsenter`` into a lab host) and hands its exit code and stdout to the matching
``parse_*``. Service names are dsv41's (``dsv41-serve``, without ``.service``); the argv name the
unit (``dsv41-serve.service``).

==============  ===========================================================
action          systemd
==============  ===========================================================
start           ``systemctl start U.service``
stop            ``systemctl stop U.service``
kill            ``systemctl kill --kill-whom=main --signal=SIG U.service``
state           ``systemctl is-active U.service``
main pid        ``systemctl show -p MainPID --value U.service``
list            ``systemctl list-units --all --no-legend --plain --type=service 'dsv41-*'``
reset failed    ``systemctl reset-failed U.service``
==============  ===========================================================

Source: systemctl(1) of systemd 252 (Debian 12, the lab's rootfs: its systemctl accepts
``--kill-whom`` and the older spelling ``--kill-who``, checked on this machine; a systemd from
before the rename knows only ``--kill-who``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv41.errors import Dsv41Error

#: The service managers, as ``dsv41_service_manager`` and ``--service-manager`` name them.
MANAGERS: tuple[str, ...] = ("systemd",)
#: Every dsv41 service name starts with it.
SERVICE_PREFIX = "dsv41-"
# systemd unit-name characters (systemd.unit(5)) without the escaping backslash. A leading '-' is refused so no name reads as an option.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,127}$")
_SIGNAL = re.compile(r"^(SIG)?[A-Z][A-Z0-9+]{1,12}$|^[0-9]{1,2}$")


class ServiceControlError(Dsv41Error):
    """An unknown service manager, or a bad service or signal name."""


def check_manager(name: str) -> str:
    """``name`` unchanged when it is one of :data:`MANAGERS`; ServiceControlError otherwise, the
    one line every CLI with ``--service-manager`` prints."""
    if name not in MANAGERS:
        raise ServiceControlError(f"--service-manager must be one of {', '.join(MANAGERS)}, not {name!r}")
    return name


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ServiceControlError(f"bad service name {name!r} (letters, digits, '_', '-', '.', '@', ':')")
    return name


def _check_signal(sig: str) -> str:
    if not _SIGNAL.match(sig):
        raise ServiceControlError(f"bad signal {sig!r} (a name such as KILL or TERM, or a number)")
    return sig.removeprefix("SIG")


@dataclass(frozen=True)
class ServiceControl:
    """Builders and parsers for one manager. Use :func:`for_manager`; ``prefix`` is the tool's
    argv (``["systemctl"]``)."""

    manager: str
    prefix: tuple[str, ...]
    tool: str = field(init=False, default="systemctl")
    #: The states of a running service (a stop is needed; a start is not).
    up_states: frozenset[str] = field(init=False, default=frozenset({"active"}))

    # ---- builders ------------------------------------------------------------------------------

    def _target(self, name: str) -> str:
        return f"{_check_name(name)}.service"

    def start(self, name: str) -> list[str]:
        """argv that starts ``name`` (systemctl waits for the start to finish)."""
        return [*self.prefix, "start", self._target(name)]

    def stop(self, name: str) -> list[str]:
        """argv that stops ``name`` (systemctl waits for it to exit)."""
        return [*self.prefix, "stop", self._target(name)]

    def kill(self, name: str, signal: str = "KILL") -> list[str]:
        """argv that sends ``signal`` (``KILL``, ``TERM``, ``SIGKILL``, a number) to the main process
        of ``name`` only (``--kill-whom=main``). ServiceControlError for a bad signal name."""
        sig = _check_signal(signal)
        return [*self.prefix, "kill", "--kill-whom=main", f"--signal={sig}", self._target(name)]

    def state(self, name: str) -> list[str]:
        """argv that prints the state of ``name`` (:meth:`parse_state` reads it; its exit code is
        not an error: systemctl exits non-zero for a service that is not active)."""
        return [*self.prefix, "is-active", self._target(name)]

    def main_pid(self, name: str) -> list[str]:
        """argv that prints the main pid of ``name`` (:meth:`parse_main_pid` reads it)."""
        return [*self.prefix, "show", "-p", "MainPID", "--value", self._target(name)]

    def list_services(self, prefix: str = SERVICE_PREFIX) -> list[str]:
        """argv that lists the services whose names start with ``prefix`` (:meth:`parse_list`
        reads its stdout when it exits 0); ServiceControlError for a prefix that is not the start of a service name."""
        if not _NAME.match(prefix):
            raise ServiceControlError(f"bad service name prefix {prefix!r}")
        return [*self.prefix, "list-units", "--all", "--no-legend", "--plain", "--type=service", f"{prefix}*"]

    def reset_failed(self, name: str) -> list[str]:
        """argv that clears a failed unit's start limit before a start (as control.yml does)."""
        return [*self.prefix, "reset-failed", self._target(name)]

    def describe(self, argv: Sequence[str]) -> str:
        """``argv`` as a record says it: the tool's name instead of its path
        (``systemctl stop dsv41-drafter.service``)."""
        rest = list(argv)[len(self.prefix) :] if list(argv)[: len(self.prefix)] == list(self.prefix) else list(argv)
        return " ".join([self.tool, *rest])

    # ---- parsers -------------------------------------------------------------------------------

    def parse_state(self, name: str, stdout: str) -> str:
        """The state word from :meth:`state`'s stdout (``active``, ``failed``, ...); ``unknown``
        when it names no state of ``name``."""
        words = stdout.split()
        return words[0] if len(words) == 1 and words[0].isalpha() else "unknown"

    def parse_main_pid(self, stdout: str) -> int | None:
        """The main pid from :meth:`main_pid`'s stdout; None when the service runs no process
        (systemd prints 0)."""
        out = stdout.strip()
        return int(out) if out.isdigit() and int(out) > 1 else None

    def parse_list(self, stdout: str, prefix: str = SERVICE_PREFIX) -> dict[str, str]:
        """``{service: state}`` from :meth:`list_services`' stdout, names without ``.service``,
        only those starting with ``prefix``."""
        out = {}
        for line in stdout.splitlines():
            parts = line.split()  # UNIT LOAD ACTIVE SUB DESCRIPTION
            if len(parts) > 2 and parts[0].startswith(prefix):
                out[parts[0].removesuffix(".service")] = parts[2]
        return out


def for_manager(name: str) -> ServiceControl:
    """The :class:`ServiceControl` of manager ``name`` (one of :data:`MANAGERS`);
    ServiceControlError for an unknown manager."""
    check_manager(name)
    return ServiceControl(name, ("systemctl",))
