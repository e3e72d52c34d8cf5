"""The command lines that drive a dsv41 service through the host's service manager: systemd
(production, the nspawn lab) or supervisord (the netns lab). Used where Python drives or reads
services (``dsv41 drill``, ``dsv41 status --local``); roles/dsv41_service tasks/control.yml is the
Ansible side of the same job and the names follow it: the managers ``systemd`` and ``supervisor``
(``dsv41_service_manager``), the actions ``start``, ``stop``, ``kill``, and the states as each
manager prints them (supervisor: ``RUNNING``, ``STOPPED``, ``FATAL``, ...; systemd's
ActiveState: ``active``, ``inactive``, ``failed``, ``activating``, ...).

Every builder returns an argv list (no shell); the caller runs it where the service lives (on the
host itself, or ``nsenter`` into a lab host) and hands its exit code and stdout to the matching
``parse_*``. Service names are dsv41's (``dsv41-serve``, without ``.service``); systemd argv name
the unit (``dsv41-serve.service``).

==============  ===========================================  =========================================
action          systemd                                      supervisor
==============  ===========================================  =========================================
start           ``systemctl start U.service``                ``supervisorctl start P``
stop            ``systemctl stop U.service``                 ``supervisorctl stop P``
kill            ``systemctl kill --kill-whom=main             ``supervisorctl signal SIG P`` (supervisord
                --signal=SIG U.service``                     signals the process it started)
state           ``systemctl is-active U.service``            ``supervisorctl status P``
main pid        ``systemctl show -p MainPID --value          ``supervisorctl pid P``
                U.service``
list            ``systemctl list-units --all --no-legend     ``supervisorctl status``
                --plain --type=service 'dsv41-*'``
reset failed    ``systemctl reset-failed U.service``         none (supervisord has no start limit to
                                                             clear)
==============  ===========================================  =========================================

Sources: systemctl(1) of systemd 252 (Debian 12, the lab's rootfs: its systemctl accepts
``--kill-whom`` and the older spelling ``--kill-who``, checked on this machine; a systemd from
before the rename knows only ``--kill-who``), supervisorctl's ``help`` of supervisor 4.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Sequence

from dsv41.errors import Dsv41Error

#: The service managers, as ``dsv41_service_manager`` and ``--service-manager`` name them.
MANAGERS: tuple[str, ...] = ("systemd", "supervisor")
#: The supervisorctl of a lab host when none is given (the lab's supervisord.conf).
DEFAULT_SUPERVISORCTL: tuple[str, ...] = ("supervisorctl", "-c", "/etc/dsv41/supervisord.conf")
#: Every dsv41 service name starts with it.
SERVICE_PREFIX = "dsv41-"
# systemd unit-name characters (systemd.unit(5)) without the escaping backslash; also every
# supervisor program name dsv41 writes. A leading '-' is refused so no name reads as an option.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,127}$")
_SIGNAL = re.compile(r"^(SIG)?[A-Z][A-Z0-9+]{1,12}$|^[0-9]{1,2}$")


class ServiceControlError(Dsv41Error):
    """An unknown service manager, a bad service or signal name, or options that do not fit the
    manager (``--supervisorctl`` with systemd)."""


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
    argv (``["systemctl"]``, or the supervisorctl command line with its ``-c`` config)."""

    manager: str
    prefix: tuple[str, ...]
    tool: str = field(init=False)
    #: The states of a running service (a stop is needed; a start is not).
    up_states: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool", "systemctl" if self.manager == "systemd" else "supervisorctl")
        object.__setattr__(self, "up_states", frozenset({"active"} if self.manager == "systemd" else {"RUNNING"}))

    # ---- builders ------------------------------------------------------------------------------

    def _target(self, name: str) -> str:
        return f"{_check_name(name)}.service" if self.manager == "systemd" else _check_name(name)

    def start(self, name: str) -> list[str]:
        """argv that starts ``name`` (both managers wait for the start to finish)."""
        return [*self.prefix, "start", self._target(name)]

    def stop(self, name: str) -> list[str]:
        """argv that stops ``name`` (both managers wait for it to exit)."""
        return [*self.prefix, "stop", self._target(name)]

    def kill(self, name: str, signal: str = "KILL") -> list[str]:
        """argv that sends ``signal`` (``KILL``, ``TERM``, ``SIGKILL``, a number) to the main process
        of ``name`` only (systemd: ``--kill-whom=main``; supervisord signals the process it started).
        ServiceControlError for a bad signal name."""
        sig = _check_signal(signal)
        if self.manager == "systemd":
            return [*self.prefix, "kill", "--kill-whom=main", f"--signal={sig}", self._target(name)]
        return [*self.prefix, "signal", sig, self._target(name)]

    def state(self, name: str) -> list[str]:
        """argv that prints the state of ``name`` (:meth:`parse_state` reads it; its exit code is
        not an error: both managers exit non-zero for a service that is not running)."""
        verb = "is-active" if self.manager == "systemd" else "status"
        return [*self.prefix, verb, self._target(name)]

    def main_pid(self, name: str) -> list[str]:
        """argv that prints the main pid of ``name`` (:meth:`parse_main_pid` reads it)."""
        if self.manager == "systemd":
            return [*self.prefix, "show", "-p", "MainPID", "--value", self._target(name)]
        return [*self.prefix, "pid", self._target(name)]

    def list_services(self, prefix: str = SERVICE_PREFIX) -> list[str]:
        """argv that lists the services whose names start with ``prefix`` (:meth:`parse_list`);
        ServiceControlError for a prefix that is not the start of a service name."""
        if not _NAME.match(prefix):
            raise ServiceControlError(f"bad service name prefix {prefix!r}")
        if self.manager == "systemd":
            return [*self.prefix, "list-units", "--all", "--no-legend", "--plain", "--type=service", f"{prefix}*"]
        return [*self.prefix, "status"]

    def reset_failed(self, name: str) -> list[str] | None:
        """argv that clears a failed unit's start limit before a start (as control.yml does);
        None under supervisor (nothing to clear)."""
        if self.manager == "systemd":
            return [*self.prefix, "reset-failed", self._target(name)]
        return None

    def describe(self, argv: Sequence[str]) -> str:
        """``argv`` as a record says it: the tool's name instead of its path and config
        (``supervisorctl stop dsv41-drafter``, ``systemctl stop dsv41-drafter.service``)."""
        rest = list(argv)[len(self.prefix):] if list(argv)[:len(self.prefix)] == list(self.prefix) else list(argv)
        return " ".join([self.tool, *rest])

    # ---- parsers -------------------------------------------------------------------------------

    def parse_state(self, name: str, stdout: str) -> str:
        """The state word from :meth:`state`'s stdout (``RUNNING``, ``active``, ...); ``UNKNOWN``
        (supervisor) or ``unknown`` (systemd) when it names no state of ``name``."""
        words = stdout.split()
        if self.manager == "systemd":
            return words[0] if len(words) == 1 and words[0].isalpha() else "unknown"
        return words[1] if len(words) > 1 and words[0] == name else "UNKNOWN"

    def parse_main_pid(self, stdout: str) -> int | None:
        """The main pid from :meth:`main_pid`'s stdout; None when the service runs no process
        (systemd prints 0; supervisorctl prints 0 or an ERROR line)."""
        out = stdout.strip()
        return int(out) if out.isdigit() and int(out) > 1 else None

    def list_ok(self, returncode: int, stdout: str) -> bool:
        """Whether :meth:`list_services` answered (supervisorctl exits 3 when a program is not
        running: its listing is still complete)."""
        if self.manager == "systemd":
            return returncode == 0
        return returncode in (0, 3) or bool(stdout.strip())

    def parse_list(self, stdout: str, prefix: str = SERVICE_PREFIX) -> dict[str, str]:
        """``{service: state}`` from :meth:`list_services`' stdout, names without ``.service``,
        only those starting with ``prefix``."""
        out = {}
        col = 2 if self.manager == "systemd" else 1  # UNIT LOAD ACTIVE SUB ... / NAME STATE ...
        for line in stdout.splitlines():
            parts = line.split()
            if len(parts) > col and parts[0].startswith(prefix):
                out[parts[0].removesuffix(".service") if self.manager == "systemd" else parts[0]] = parts[col]
        return out


def for_manager(name: str, supervisorctl: str | Sequence[str] = "") -> ServiceControl:
    """The :class:`ServiceControl` of manager ``name`` (one of :data:`MANAGERS`).

    ``supervisorctl``: supervisor only, the supervisorctl command line (text, split with shlex, or
    argv; default :data:`DEFAULT_SUPERVISORCTL`). ServiceControlError for an unknown manager, a
    ``supervisorctl`` given with systemd (it would be ignored: systemd hosts are driven with
    systemctl), or one that does not parse (unbalanced quotes)."""
    check_manager(name)
    if isinstance(supervisorctl, str):
        try:
            argv = shlex.split(supervisorctl)
        except ValueError as exc:
            raise ServiceControlError(f"--supervisorctl {supervisorctl!r} does not parse: {exc}") from None
        given = bool(supervisorctl.strip())
    else:
        argv, given = list(supervisorctl), bool(list(supervisorctl))
    if name == "systemd":
        if given:
            raise ServiceControlError("--supervisorctl is for --service-manager supervisor only "
                                      "(systemd hosts are driven with systemctl)")
        return ServiceControl("systemd", ("systemctl",))
    return ServiceControl("supervisor", tuple(argv or DEFAULT_SUPERVISORCTL))
