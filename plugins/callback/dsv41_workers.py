# Apache License 2.0
"""Ansible callback: name promote.yml's / rollback.yml's workers by identity and end those a
SIGKILLed run left (thin; dsv41.promotion.workers)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
name: dsv41_workers
type: aggregate
short_description: End the Ansible workers a SIGKILLed promote.yml or rollback.yml left running
description:
  - ansible-core's worker processes call C(setsid()), so a SIGKILL of C(ansible-playbook)'s
    process group leaves each worker of an in-flight task running; it finishes that task while the
    next run acts on the same hosts.
  - For the playbooks named in O(playbooks), this callback first ends such leftovers of every
    recorded C(ansible-playbook) that no longer lives (by pid, kernel start ticks and boot id, never
    by name; a reused pid is never signalled) and prints what it ended, then records this run and
    every worker forked from it, and removes the record when the run ends.
  - The work is done by C(dsv41.promotion.workers); docs/promotion.md describes it.
options:
  record_dir:
    description: The directory holding the records (one subdirectory per C(ansible-playbook) run).
    type: path
    default: ~/.ansible/dsv41/workers
    env:
      - name: DSV41_WORKERS_DIR
    ini:
      - section: callback_dsv41_workers
        key: record_dir
  playbooks:
    description: The playbook file names (base names) the callback acts for.
    type: list
    elements: str
    default: [promote.yml, rollback.yml]
    ini:
      - section: callback_dsv41_workers
        key: playbooks
requirements:
  - the dsv41 Python package on the controller
author:
  - dsv41-offload (@dsv41)
"""

import os

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    """See DOCUMENTATION. A record that cannot be read or written is one warning line; the
    playbook itself is never failed by this callback."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dsv41_workers"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._recorder = None

    def v2_playbook_on_start(self, playbook):
        """End a SIGKILLed run's leftover workers, then record this run (once per process)."""
        name = os.path.basename(getattr(playbook, "_file_name", "") or "")
        if self._recorder is not None or name not in self.get_option("playbooks"):
            return
        try:
            from dsv41.promotion import workers
        except ImportError as exc:
            self._display.warning(f"dsv41_workers: the dsv41 package is not importable ({exc}); workers not recorded")
            return
        root = self.get_option("record_dir")
        ended, problems = workers.end_leftovers(root)
        for line in problems:
            self._display.warning(f"dsv41_workers: {line}")
        for e in ended:
            self._display.display(f"dsv41_workers: {e.line()}")
        try:
            self._recorder = workers.start(root, name)
        except workers.WorkersError as exc:
            self._display.warning(f"dsv41_workers: {exc}; this run's workers are not recorded")

    def v2_playbook_on_task_start(self, task, is_conditional):
        """Drop the records of workers that have returned."""
        if self._recorder is not None:
            self._recorder.prune()

    def v2_playbook_on_handler_task_start(self, task):
        """As for a task."""
        self.v2_playbook_on_task_start(task, False)

    def v2_playbook_on_stats(self, stats):
        """The run ended by itself: its record goes."""
        if self._recorder is not None:
            from dsv41.promotion import workers

            workers.stop()
            self._recorder = None
