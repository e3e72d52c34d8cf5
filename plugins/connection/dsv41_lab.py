# Lab-only connection: run every task inside the namespaces (net, mount, uts, ipc, pid) of one
# simulated host's holder process, so one machine stands in for sparkhead, sparkworker and
# x86host, each with its own addresses, hostname, /opt|/etc|/run/dsv41 and process table.
# Production inventories use ssh; nothing here is used there.
from __future__ import annotations

DOCUMENTATION = r"""
name: dsv41_lab
short_description: Execute inside a dsv41 lab host (namespaces of its holder process)
description:
  - Like the C(local) connection, but each command is wrapped in
    C(nsenter --target PID --mount --net --uts --ipc --pid --).
  - The holder PID is read from O(pidfile) at every command, so a lab brought up earlier in the
    same run is found, and a lab that is down fails with one clear message.
  - Files travel through the shared remote tmp dir, so C(remote_tmp) must not lie under a
    per-host bind mount (/opt/dsv41, /etc/dsv41, /run/dsv41).
options:
  pidfile:
    description: File holding the PID of the host's holder process (written by the lab role).
    type: path
    required: true
    vars:
      - name: ansible_dsv41_lab_pidfile
  become_success_timeout:
    type: int
    default: 10
    description: Passed through to the local connection.
    vars:
      - name: ansible_local_become_success_timeout
  become_strip_preamble:
    type: bool
    default: true
    description: Passed through to the local connection.
    vars:
      - name: ansible_local_become_strip_preamble
extends_documentation_fragment:
  - connection_pipelining
"""

import os

from ansible.errors import AnsibleConnectionFailure
from ansible.plugins.connection.local import Connection as LocalConnection


def holder_pid(pidfile):
    """Return the live holder PID from ``pidfile``.

    Raises AnsibleConnectionFailure (one line, names the file) when the file is missing, empty,
    not an int > 1, or the process is gone.
    """
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip() or "0")
    except (OSError, ValueError):
        pid = 0
    if pid <= 1 or not os.path.exists("/proc/%d" % pid):
        raise AnsibleConnectionFailure(
            "dsv41_lab: simulated host is not running (no live holder pid in %s); "
            "bring the lab up with playbooks/lab_up.yml" % pidfile
        )
    return pid


class Connection(LocalConnection):
    """Local connection whose commands run inside one lab host's namespaces."""

    transport = "dsv41_lab"

    def exec_command(self, cmd, in_data=None, sudoable=True):
        pid = holder_pid(self.get_option("pidfile"))
        prefix = "nsenter --target %d --mount --net --uts --ipc --pid -- " % pid
        return super().exec_command(prefix + cmd, in_data=in_data, sudoable=sudoable)
