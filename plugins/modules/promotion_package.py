#!/usr/bin/python
# Apache License 2.0
"""Ansible module: gate, record, read, verify and plan promotion packages (thin; dsv41.promotion.package)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: promotion_package
short_description: Record, verify and compare dsv41 promotion packages on the controller
description:
  - V(gate) checks that a window decided WIN (or that force comes with a reason).
  - V(record) builds a package from what the hosts run (managed files with their bytes, facts)
    and stores it immutably under O(root)/<id> (and <id>.tar.gz). The id is the sha256 of the
    canonical package.json; recording the same production again changes nothing. With provenance
    op V(window) (a window's snapshot), a production equal to its V(parent) package gives that id.
  - V(read) returns a package's record after verifying it; V(verify) only verifies it.
  - V(plan) compares each host's installed managed files (sha256) with a package record.
  - The work is done by C(dsv41.promotion.package); this module maps it onto Ansible.
options:
  action:
    description: What to do.
    type: str
    choices: [gate, record, read, verify, plan]
    required: true
  root:
    description: The controller's package directory.
    type: path
    required: true
  id:
    description: Package id or unique prefix (V(read), V(verify), V(plan)).
    type: str
  hosts:
    description:
      - V(record) - per host V(groups), V(rank), V(dsv41), V(image), V(engine_config), V(manifest),
        V(drafter), V(kv_budget), V(services) and V(files) (path -> V(content) base64 and V(mode)).
      - V(plan) - per host the installed listing (path -> sha256).
    type: dict
  provenance:
    description: V(record) - V(op), V(parent), V(candidate), V(window), V(verdict), V(force), V(reason), V(component).
    type: dict
  refs_path:
    description: V(record) - the greedy reference file recorded with the package (absent file - none).
    type: path
  windows_dir:
    description: V(gate) - directory of window reports (windows/<id>/decision.json).
    type: path
  window:
    description: V(gate) - window id.
    type: str
  candidate:
    description: V(gate) - the candidate to promote; a window whose decision names another one is refused.
    type: str
  force:
    description: V(gate) - promote without a WIN (needs O(reason)).
    type: bool
    default: false
  reason:
    description: V(gate) - why force was used (recorded in the package).
    type: str
attributes:
  check_mode:
    support: full
    description: V(record) computes the id and reports whether it would be stored, without writing.
  diff_mode:
    support: full
    description: V(record) and V(plan) show the files that change per host.
requirements:
  - the dsv41 Python package and jsonschema on the controller
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Verify a package
  promotion_package:
    action: verify
    root: "{{ playbook_dir }}/../packages"
    id: "{{ rollback_to }}"
  delegate_to: localhost
"""

RETURN = r"""
id:
  description: The package id (V(record), V(read), V(verify), V(plan)).
  returned: when known
  type: str
package:
  description: The package record (V(record), V(read)).
  returned: when known
  type: dict
gate:
  description: V(gate) - window, verdict, force, reason.
  returned: when action is gate
  type: dict
plan:
  description: V(plan) - per host V(write), V(remove) (paths) and V(same) (count).
  returned: when action is plan
  type: dict
verified:
  description: V(verify), V(read), V(record) - files and bytes checked.
  returned: when known
  type: dict
"""

import base64
import os

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import (
        dsv41_errors,
        import_dsv41,
        require_dsv41,
    )
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import dsv41_errors, import_dsv41, require_dsv41

pkg = import_dsv41("dsv41.promotion.package")


def _record(module, p):
    hosts = {}
    for host, h in (p["hosts"] or {}).items():
        files = {
            path: {"content": base64.b64decode(f["content"]), "mode": f.get("mode") or "0644"}
            for path, f in (h.get("files") or {}).items()
        }
        hosts[host] = dict(h, files=files)
    refs = None
    if p["refs_path"] and os.path.isfile(p["refs_path"]):
        with open(p["refs_path"], "rb") as fh:
            refs = fh.read()
    doc, blobs = pkg.build(hosts, p["provenance"] or {}, refs)
    # a window's snapshot, or a deploy, of an undrifted production is production's package: no new
    # one appears that differs only in provenance (a deploy after a bring-up or a promotion whose
    # result the inventory now holds changes nothing)
    same = pkg.same_production(p["root"], doc) if doc["provenance"]["op"] in ("window", "deploy") else None
    if same is not None:
        return dict(changed=False, id=same, package=pkg.load(p["root"], same), verified=pkg.verify(p["root"], same))
    pid = pkg.package_id(doc)
    exists = os.path.isdir(os.path.join(p["root"], pid))
    verified = None
    if not module.check_mode:
        pid, created = pkg.write(p["root"], doc, blobs)
        verified = pkg.verify(p["root"], pid)
    else:
        created = not exists
    result = dict(changed=created, id=pid, package=doc, verified=verified)
    if module._diff and created:
        result["diff"] = dict(
            before="",
            after="package {}\n{}".format(
                pid,
                "".join(
                    "{} {} {}\n".format(f["sha256"], h, path)
                    for h, hh in doc["hosts"].items()
                    for path, f in hh["files"].items()
                ),
            ),
            after_header=os.path.join(p["root"], pid),
        )
    return result


def _plan(module, p, pid):
    doc = pkg.load(p["root"], pid)
    plan = {h: pkg.installed_diff(doc, h, listing or {}) for h, listing in (p["hosts"] or {}).items()}
    result = dict(changed=False, id=pid, plan=plan, package=doc)
    if module._diff:
        result["diff"] = dict(
            before="".join(f"{h} {path}\n" for h, d in plan.items() for path in d["write"] + d["remove"]),
            after="",
            before_header=f"installed files that differ from {pid[:12]}",
            after_header=f"package {pid[:12]}",
        )
    return result


def main():
    module = AnsibleModule(
        argument_spec=dict(
            action=dict(type="str", required=True, choices=["gate", "record", "read", "verify", "plan"]),
            root=dict(type="path", required=True),
            id=dict(type="str"),
            hosts=dict(type="dict"),
            provenance=dict(type="dict"),
            refs_path=dict(type="path"),
            windows_dir=dict(type="path"),
            window=dict(type="str"),
            candidate=dict(type="str"),
            force=dict(type="bool", default=False),
            reason=dict(type="str", no_log=False),
        ),
        required_if=[
            ("action", "read", ["id"]),
            ("action", "verify", ["id"]),
            ("action", "plan", ["id", "hosts"]),
            ("action", "record", ["hosts", "provenance"]),
            ("action", "gate", ["windows_dir"]),
        ],
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    with dsv41_errors(module):
        if p["action"] == "gate":
            module.exit_json(
                changed=False,
                gate=pkg.check_window(p["windows_dir"], p["window"], p["force"], p["reason"], p["candidate"]),
            )
        if p["action"] == "record":
            module.exit_json(**_record(module, p))
        pid = pkg.resolve(p["root"], p["id"])
        verified = pkg.verify(p["root"], pid)
        if p["action"] == "verify":
            module.exit_json(changed=False, id=pid, verified=verified)
        if p["action"] == "read":
            module.exit_json(changed=False, id=pid, verified=verified, package=pkg.load(p["root"], pid))
        module.exit_json(**_plan(module, p, pid))


if __name__ == "__main__":
    main()
