#!/usr/bin/python
# Apache License 2.0
"""Ansible module: assemble and write the qualification report (logic: dsv41.entrypoints.qualify)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: qualify_report
short_description: Write the dsv41 hardware qualification report (report.json, summary.md)
description:
  - Turns the results that C(playbooks/qualify.yml) registered on every host (and on the
    controller) into one record per check (pass, fail, or skipped with the reason) and writes
    C(report.json) and C(summary.md) into O(out_dir).
  - Fails, naming each failed check, when any check failed or a host could not be reached.
  - Writes the report in check mode too (the report is the controller's record of the run; the
    hosts are only read).
options:
  hosts:
    description: Per inventory host, C(version) (the registered C(dsv41 version --json)), C(done) and C(steps).
    type: dict
    required: true
  controller:
    description: Steps that ran on the controller (same shape as a host's steps).
    type: list
    elements: dict
    default: []
  out_dir:
    description: Report directory on the controller (prepared by C(dsv41 qualify preflight)).
    type: path
    required: true
  meta:
    description: Id, inventory, start time, expectations and check mode, copied into the report.
    type: dict
    default: {}
attributes:
  check_mode:
    support: full
    description: Writes the report also in check mode; nothing on the hosts changes.
  diff_mode:
    support: none
    description: A new report directory per run; nothing to diff.
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Write the report
  qualify_report:
    hosts: "{{ qualify_raw }}"
    out_dir: /srv/dsv41/qualify/20261202T010203Z
"""

RETURN = r"""
result:
  description: PASS or FAIL.
  returned: always
  type: str
counts:
  description: Checks per status (pass, fail, skipped).
  returned: always
  type: dict
failed:
  description: C(<check id>@<host>) of each failed check.
  returned: always
  type: list
  elements: str
report:
  description: Path of report.json.
  returned: success
  type: str
summary:
  description: Path of summary.md.
  returned: success
  type: str
lines:
  description: The summary as lines (for the playbook's output).
  returned: success
  type: list
  elements: str
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

qualify = import_dsv41("dsv41.entrypoints.qualify")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            hosts=dict(type="dict", required=True),
            controller=dict(type="list", elements="dict", default=[]),
            out_dir=dict(type="path", required=True),
            meta=dict(type="dict", default={}),
        ),
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    with dsv41_errors(module):
        report = qualify.assemble(p["hosts"], controller=p["controller"], meta=p["meta"])
        paths = qualify.write_report(report, p["out_dir"])
    out = dict(
        changed=True,
        result=report["result"],
        counts=report["counts"],
        failed=report["failed"],
        lines=qualify.render_summary(report).splitlines(),
        **paths,
    )
    if report["result"] != "PASS":
        module.fail_json(msg=qualify.failure_line(report) + " (summary: {})".format(paths["summary"]), **out)
    module.exit_json(**out)


if __name__ == "__main__":
    main()
