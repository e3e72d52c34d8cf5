#!/usr/bin/python
# Apache License 2.0
"""Ansible module: validate a component name or check a per-component rollback (thin; dsv41.harness.components)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: component_check
short_description: Check the behaviour after one component of the offload stack was rolled back
description:
  - With O(stage=validate), only checks that O(component) names a component that can be rolled
    back on its own (one clear error otherwise); sends nothing.
  - With O(stage=check), sends traffic to rank 0 (the greedy reference prompts, compared with the
    recorded ones, then a burst of concurrent greedy completions), reads the engine's, the drafter
    worker's and the table server's counters before and after, and judges the behaviour the
    seed's rollback table names for the component. Fails naming every check that did not pass.
  - The work is done by C(dsv41.harness.components); this module only maps it onto Ansible.
options:
  component:
    description: V(async_handoff), V(remote_drafter) or V(remote_engram).
    type: str
    required: true
  stage:
    description: V(validate) the name only, or V(check) the behaviour.
    type: str
    choices: [validate, check]
    default: validate
  endpoint:
    description: Base URL of rank 0 (required for V(check)).
    type: str
  refs_path:
    description: The recorded greedy references (required for V(check)).
    type: path
  metrics_url:
    description: Rank 0's C(/metrics) URL (default O(endpoint)/metrics).
    type: str
  rank_metrics:
    description:
      - Where each TP rank's Engram and drafter counters are read (the inventory's
        C(dsv41_rank_metrics), as C(dsv41.harness.rank_metrics.urls) takes it). Under V(vllm)
        each Spark's overlay endpoint; an unreachable one fails the check naming the rank and the
        endpoint. Empty - everything from O(metrics_url).
    type: dict
  worker_metrics_url:
    description: The drafter worker's C(/metrics) URL (required for V(check)).
    type: str
  server_metrics_url:
    description: The Engram table server's C(/metrics) URL (required for V(check)).
    type: str
  envs:
    description: Per host, the text of its drafter and Engram overlay environment files.
    type: dict
    default: {}
  drafting_hosts:
    description: Hosts whose engine drafts (after a remote_drafter rollback they must draft locally).
    type: list
    elements: str
    default: []
  kv_baseline:
    description: The KV budget in tokens without capacity mode (C(serve_kv_cache_tokens)).
    type: int
    default: 65536
  burst:
    description: Concurrent greedy completions sent after the references.
    type: int
    default: 8
  max_tokens:
    description: Tokens per burst completion.
    type: int
    default: 16
  timeout:
    description: Seconds per completion.
    type: float
    default: 120.0
attributes:
  check_mode:
    support: full
    description: The name is validated; no traffic is sent (the rollback itself changed nothing).
  diff_mode:
    support: none
    description: Nothing on a host is changed by this module, so there is no diff.
requirements:
  - the dsv41 Python package and httpx on the host that runs the module
extends_documentation_fragment:
  - dsv41.offload.window_token
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Refuse an unknown component before anything changes
  component_check:
    component: "{{ component }}"
  delegate_to: localhost

- name: Check the synchronous rounds after the async handoff was removed
  component_check:
    component: async_handoff
    stage: check
    endpoint: http://198.18.0.11:8000
    refs_path: /var/lib/dsv41-lab/refs/greedy_refs.json
    worker_metrics_url: http://198.18.0.13:9451/metrics
    server_metrics_url: http://198.18.0.13:9441/metrics
  delegate_to: localhost
"""

RETURN = r"""
behaviour:
  description: The behaviour the seed's rollback table names for the component.
  returned: always
  type: str
role_vars:
  description: The role variables that switch the component off (set over production's values).
  returned: when stage is validate or in check mode
  type: dict
ok:
  description: Every check passed (V(stage=check) only).
  returned: when stage is check and not in check mode
  type: bool
checks:
  description: Per check, C(name), C(ok) and a one-line C(detail) with the numbers judged.
  returned: when stage is check and not in check mode
  type: list
  elements: dict
before:
  description: Counters before the traffic (engine, engram per rank, worker, server).
  returned: when stage is check and not in check mode
  type: dict
after:
  description: Counters after the traffic.
  returned: when stage is check and not in check mode
  type: dict
seconds:
  description: Time the check took.
  returned: when stage is check and not in check mode
  type: float
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

dsv41_rank_metrics = import_dsv41("dsv41.harness.rank_metrics")
dsv41_components = import_dsv41("dsv41.harness.components")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            component=dict(type="str", required=True),
            stage=dict(type="str", default="validate", choices=["validate", "check"]),
            endpoint=dict(type="str"),
            refs_path=dict(type="path"),
            metrics_url=dict(type="str"),
            worker_metrics_url=dict(type="str"),
            server_metrics_url=dict(type="str"),
            envs=dict(type="dict", default={}),
            drafting_hosts=dict(type="list", elements="str", default=[]),
            kv_baseline=dict(type="int", default=65536),
            burst=dict(type="int", default=8),
            max_tokens=dict(type="int", default=16, no_log=False),  # a token count, not a secret
            timeout=dict(type="float", default=120.0),
            rank_metrics=dict(type="dict"),
            **WINDOW_TOKEN_SPEC,
        ),
        required_if=[("stage", "check", ("endpoint", "refs_path", "worker_metrics_url", "server_metrics_url"))],
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    with dsv41_errors(module, component=p["component"]), window_token(module):
        name = dsv41_components.component(p["component"])
        behaviour = dsv41_components.COMPONENTS[name]
        if p["stage"] == "validate" or module.check_mode:
            module.exit_json(changed=False, behaviour=behaviour, role_vars=dsv41_components.ROLE_VARS[name])
        res = dsv41_components.run(
            name,
            p["endpoint"],
            p["refs_path"],
            engine_metrics_url=p["metrics_url"] or p["endpoint"].rstrip("/") + "/metrics",
            worker_metrics_url=p["worker_metrics_url"],
            server_metrics_url=p["server_metrics_url"],
            envs={str(k): str(v) for k, v in p["envs"].items()},
            kv_baseline=p["kv_baseline"],
            drafting_hosts=p["drafting_hosts"],
            burst=p["burst"],
            max_tokens=p["max_tokens"],
            timeout_s=p["timeout"],
            rank_urls=dsv41_rank_metrics.urls(p["rank_metrics"]) if p["rank_metrics"] else None,
        )
    result = dict(changed=False, behaviour=behaviour, **res.to_dict())
    if not res.ok:
        module.fail_json(msg=f"{name} rollback check failed: {res.message()}", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
