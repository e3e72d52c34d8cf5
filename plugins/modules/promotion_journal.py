#!/usr/bin/python
# Apache License 2.0
"""Ansible module: append to / decide from the promotion journal (thin; dsv41.promotion.journal)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: promotion_journal
short_description: The controller's promotion journal (append-only JSONL, fsync per step)
description:
  - V(append) writes one step of a promote or rollback (fsync-ed before the play goes on).
  - V(decide) reads the journal and says what a run must do first after an interruption -
    V(finish) the interrupted operation's verified package, V(revert) to the package that was
    production when it began, or V(none).
  - The work is done by C(dsv41.promotion.journal).
options:
  action:
    description: What to do.
    type: str
    choices: [append, decide]
    required: true
  path:
    description: The journal file.
    type: path
    required: true
  op:
    description: V(append) - the operation id (one per run).
    type: str
  step:
    description: V(append) - the step name (begin, held, applied, verified, recorded, pointer, reopened, rolled_back, recovered, failed, done).
    type: str
  fields:
    description: V(append) - more JSON fields of the entry.
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    description: V(append) writes nothing in check mode (a check run changes nothing).
  diff_mode:
    support: none
    description: A journal line is a log entry, not a change to show.
requirements:
  - the dsv41 Python package on the controller
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Journal the HOLD
  promotion_journal:
    action: append
    path: "{{ promotion_journal }}"
    op: "{{ promotion_op }}"
    step: held
  delegate_to: localhost
"""

RETURN = r"""
entry:
  description: V(append) - the entry written.
  returned: when action is append
  type: dict
decision:
  description: V(decide) - V(action), V(package), V(op), V(kind), V(last_step).
  returned: when action is decide
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import (
        dsv41_errors,
        import_dsv41,
        require_dsv41,
    )
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import dsv41_errors, import_dsv41, require_dsv41

journal = import_dsv41("dsv41.promotion.journal")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            action=dict(type="str", required=True, choices=["append", "decide"]),
            path=dict(type="path", required=True),
            op=dict(type="str"),
            step=dict(type="str"),
            fields=dict(type="dict", default={}),
        ),
        required_if=[("action", "append", ["op", "step"])],
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    with dsv41_errors(module, path=p["path"]):
        if p["action"] == "decide":
            module.exit_json(changed=False, decision=journal.decide(journal.read(p["path"])).as_dict())
        if module.check_mode:
            module.exit_json(changed=False, entry=dict(op=p["op"], step=p["step"], **p["fields"]))
        # a log line, not a change of production: never reported as changed (idempotence)
        module.exit_json(changed=False, entry=journal.append(p["path"], p["op"], p["step"], **p["fields"]))


if __name__ == "__main__":
    main()
