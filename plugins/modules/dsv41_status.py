#!/usr/bin/python
# Apache License 2.0
"""Ansible module: probe the dsv41 endpoints and judge the stack's health (thin; dsv41.entrypoints.status)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dsv41_status
short_description: Probe the dsv41 serving stack and report whether it is healthy
description:
  - Reads rank 0's C(/health), C(/is_paused) and C(/metrics) (twice, O(window) seconds apart), the
    Engram table server's C(/ready) and the drafter worker's C(/metrics), combines them with what each
    host reported about itself (C(dsv41 status --local --json)) and returns the report, its verdict
    and summary lines.
  - Changes nothing. The work is done by C(dsv41.entrypoints.status), the same code as C(dsv41 status).
options:
  hosts:
    description:
      - Per inventory host, C(groups), C(rank) and the registered result of C(dsv41 status --local --json)
        on that host (C(unreachable), C(msg), C(rc), C(stdout), C(stderr)).
    type: dict
    required: true
  api_url:
    description: Rank 0's base URL, for example V(http://198.18.0.11:8000).
    type: str
    required: true
  engram_url:
    description: Base URL of the Engram table server's metrics endpoint (C(/ready)); empty to skip.
    type: str
    default: ""
  drafter_url:
    description: Base URL of the drafter worker's metrics endpoint; empty to skip.
    type: str
    default: ""
  window:
    description: Seconds between the two reads of rank 0's C(/metrics) (the "last N seconds" deltas).
    type: float
    default: 5.0
  expected_image:
    description: The configured serving image (pinned by digest), compared with the running one.
    type: str
    default: ""
  windows_dir:
    description: Directory of fenced windows (C(<id>/decision.json)); the newest verdict is reported.
    type: str
    default: ""
  prometheus_url:
    description:
      - Base URL of a Prometheus with the dsv41 rules (roles/monitoring); its firing alerts join the report
        (critical ones as reasons, others as warnings). Empty to skip.
    type: str
    default: ""
  rank_metrics:
    description:
      - Where each TP rank's counters are read (the inventory's C(dsv41_rank_metrics), as
        C(dsv41.harness.rank_metrics.urls) takes it); under V(vllm) each rank's overlay endpoint, and
        an unreachable one, or an overlay that is not active, is a reason naming the rank and the
        endpoint. Empty - rank 0's C(/metrics).
    type: dict
  timeout:
    description: Seconds per HTTP request.
    type: float
    default: 5.0
attributes:
  check_mode:
    support: full
    description: Only reads; runs the same in check mode.
  diff_mode:
    support: none
    description: Nothing changes, so there is no diff.
requirements:
  - the dsv41 Python package and httpx on the host that runs the module (the controller)
extends_documentation_fragment:
  - dsv41.offload.window_token
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Probe and judge
  dsv41_status:
    hosts: "{{ status_hosts }}"
    api_url: http://198.18.0.11:8000
    engram_url: http://198.18.0.13:9441
    drafter_url: http://198.18.0.13:9451
  register: status_result
  delegate_to: localhost
"""

RETURN = r"""
healthy:
  description: Whether every check passed.
  returned: always
  type: bool
reasons:
  description: One line per failed check (unreachable host or rank, fallbacks growing, admission held, identity mismatch...).
  returned: always
  type: list
  elements: str
lines:
  description: The summary as plain lines (what C(dsv41 status) prints without a terminal).
  returned: always
  type: list
  elements: str
report:
  description: The whole report (the JSON C(dsv41 status --json) prints).
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import (
        WINDOW_TOKEN_SPEC,
        dsv41_errors,
        import_dsv41,
        require_dsv41,
        window_token,
    )
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import (
        WINDOW_TOKEN_SPEC,
        dsv41_errors,
        import_dsv41,
        require_dsv41,
        window_token,
    )

dsv41_status = import_dsv41("dsv41.entrypoints.status")
dsv41_status_render = import_dsv41("dsv41.entrypoints.status_render")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            hosts=dict(type="dict", required=True),
            api_url=dict(type="str", required=True),
            engram_url=dict(type="str", default=""),
            drafter_url=dict(type="str", default=""),
            window=dict(type="float", default=5.0),
            expected_image=dict(type="str", default=""),
            windows_dir=dict(type="str", default=""),
            timeout=dict(type="float", default=5.0),
            prometheus_url=dict(type="str", default=""),
            rank_metrics=dict(type="dict"),
            **WINDOW_TOKEN_SPEC,
        ),
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    with dsv41_errors(module), window_token(module):
        report = dsv41_status.summarize(
            p["hosts"],
            p["api_url"],
            p["engram_url"] or None,
            p["drafter_url"] or None,
            window_s=p["window"],
            expected_image=p["expected_image"],
            windows_dir=p["windows_dir"] or None,
            timeout_s=p["timeout"],
            prometheus_url=p["prometheus_url"] or None,
            rank_metrics=p["rank_metrics"] or None,
        )
    module.exit_json(
        changed=False,
        healthy=report["healthy"],
        reasons=report["reasons"],
        lines=dsv41_status_render.render_lines(report),
        report=report,
    )


if __name__ == "__main__":
    main()
