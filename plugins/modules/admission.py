#!/usr/bin/python
# Apache License 2.0
"""Ansible module: HOLD or release admission of the serving endpoint (thin; dsv41.harness.admission)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: admission
short_description: Pause, resume or read admission of the dsv41 serving endpoint
description:
  - Reads C(GET /is_paused) of the rank 0 HTTP endpoint and, when the wanted state differs, sends
    C(POST /pause) or C(POST /resume), then waits until the endpoint reports the new state.
  - The work is done by C(dsv41.harness.admission); this module only maps it onto Ansible
    (check mode, diff, result).
options:
  endpoint:
    description: Base URL of rank 0, for example V(http://198.18.0.11:8000).
    type: str
    required: true
  state:
    description:
      - V(held) stops admitting new requests (HOLD), V(open) admits again, V(status) only reads.
      - While E(DSV41_WINDOW_TOKEN) is set, V(held) always sends the HOLD with that token (the held
        engine admits only requests carrying it), also when admission is held already; C(changed)
        reports only a change of the admission state.
    type: str
    choices: [held, open, status]
    default: status
  timeout:
    description: Seconds per HTTP request.
    type: float
    default: 10.0
  settle:
    description: Seconds to wait for the endpoint to report the new state.
    type: float
    default: 10.0
attributes:
  check_mode:
    support: full
    description: Reads the state and reports the change it would make without sending it.
  diff_mode:
    support: full
    description: Shows the admission state before and after.
requirements:
  - the dsv41 Python package and httpx on the host that runs the module
extends_documentation_fragment:
  - dsv41.offload.window_token
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: HOLD admission
  admission:
    endpoint: http://198.18.0.11:8000
    state: held
  delegate_to: localhost

- name: Release it
  admission:
    endpoint: http://198.18.0.11:8000
    state: open
  delegate_to: localhost
"""

RETURN = r"""
previous:
  description: Admission state before the call.
  returned: always
  type: str
  sample: held
state:
  description: Admission state after the call (the wanted one in check mode).
  returned: always
  type: str
  sample: open
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

dsv41_admission = import_dsv41("dsv41.harness.admission")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            endpoint=dict(type="str", required=True),
            state=dict(type="str", default="status", choices=["held", "open", "status"]),
            timeout=dict(type="float", default=10.0),
            settle=dict(type="float", default=10.0),
            **WINDOW_TOKEN_SPEC,
        ),
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    with dsv41_errors(module, endpoint=p["endpoint"]), window_token(module):
        before = dsv41_admission.status(p["endpoint"], p["timeout"])
        want = before if p["state"] == "status" else p["state"]
        changed = want != before
        # A HOLD is (re)sent while DSV41_WINDOW_TOKEN is set even when already held (set_state
        # decides): it names the fenced operation the held engine admits, replacing an older one
        # (a killed run's). Only a change of the admission state itself counts as changed.
        if (changed or want == "held") and not module.check_mode:
            dsv41_admission.set_state(p["endpoint"], want, p["timeout"], p["settle"])
    result = dict(changed=changed, previous=before, state=want)
    if module._diff:
        result["diff"] = dict(
            before=f"admission: {before}\n",
            after=f"admission: {want}\n",
            before_header=p["endpoint"],
            after_header=p["endpoint"],
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
