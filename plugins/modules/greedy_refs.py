#!/usr/bin/python
# Apache License 2.0
"""Ansible module: record or compare the six greedy references (thin; dsv41.harness.refs)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: greedy_refs
short_description: Record or verify the six greedy reference prompts of the dsv41 endpoint
description:
  - Runs the six reference prompts at temperature 0 against the rank 0 endpoint and either
    records their token ids (first deploy) or compares them with the recorded ones, reporting the
    first differing position per prompt.
  - Optionally reads the Engram counters of every rank from O(metrics_url) before and after the
    prompts, so the caller can check that lookups were counted on every rank with zero fallbacks.
  - The work is done by C(dsv41.harness.refs); this module maps it onto Ansible.
options:
  endpoint:
    description: Base URL of rank 0, for example V(http://198.18.0.11:8000).
    type: str
    required: true
  path:
    description: Refs file (JSON) on the host that runs the module (normally the controller).
    type: path
    required: true
  mode:
    description:
      - V(auto) records when O(path) does not exist and verifies otherwise.
      - V(record) always records (overwrites); V(verify) fails when O(path) is missing.
    type: str
    choices: [auto, record, verify]
    default: auto
  max_tokens:
    description: New tokens per prompt when recording (verify uses the recorded value).
    type: int
    default: 16
  timeout:
    description: Seconds per HTTP request.
    type: float
    default: 120.0
  metrics_url:
    description: Rank 0 C(/metrics) URL; when set, Engram counters are read before and after.
    type: str
  rank_metrics:
    description:
      - The runtime facts that say where each TP rank's counters are read (the inventory's
        C(dsv41_rank_metrics)) - V(runtime) (V(lab) or V(vllm)), V(api_url), V(ranks) (rank to
        management address) and V(overlay_port). Under V(vllm) every rank's overlay endpoint is
        read and each rank in O(require_ranks) must report its overlay active. Replaces
        O(metrics_url) when set.
    type: dict
  metrics_prefix:
    description: Name prefix of the Engram counters on O(metrics_url).
    type: str
    default: dsv41_engram_
  require_ranks:
    description:
      - Ranks (label values) whose Engram counters must show lookups and zero fallbacks while the
        prompts run. Needs O(metrics_url).
    type: list
    elements: str
    default: []
  require_drafter:
    description: Rank 0's speculator must run drafting rounds without identity refusals. Needs O(metrics_url).
    type: bool
    default: false
  attempts:
    description:
      - Runs of the prompts until the counter requirements hold (a table server restored a moment
        ago may still be reconnecting). A token mismatch fails at once.
    type: int
    default: 1
  delay:
    description: Seconds between attempts.
    type: float
    default: 2.0
attributes:
  check_mode:
    support: full
    description: Runs the prompts (read-only on the endpoint) but writes no refs file.
  diff_mode:
    support: none
    description: Not supported; the result lists the first differing position per prompt.
requirements:
  - the dsv41 Python package and httpx on the host that runs the module
extends_documentation_fragment:
  - dsv41.offload.window_token
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Greedy references (record on first deploy, compare afterwards)
  greedy_refs:
    endpoint: http://198.18.0.11:8000
    path: /var/lib/dsv41-lab/refs/greedy_refs.json
    metrics_url: http://198.18.0.11:8000/metrics
  delegate_to: localhost
"""

RETURN = r"""
action:
  description: What was done, V(recorded) or V(verified).
  returned: always
  type: str
identical:
  description: Number of prompts whose token ids equal the recorded ones (all when recording).
  returned: always
  type: int
total:
  description: Number of prompts.
  returned: always
  type: int
prompts:
  description: Per prompt, name, first differing position (null when identical) and token ids.
  returned: always
  type: list
  elements: dict
counters_delta:
  description: Engram counters per rank, after minus before (only with O(metrics_url)).
  returned: when metrics_url is set
  type: dict
drafter_delta:
  description: Speculator counters of rank 0 (C(dsv41_drafter_*)), after minus before.
  returned: when metrics_url is set
  type: dict
attempts:
  description: Runs of the prompts made.
  returned: always
  type: int
summary:
  description: One line, for example C(6/6 identical).
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import (
        WINDOW_TOKEN_SPEC,
        Dsv41Error,
        import_dsv41,
        require_dsv41,
        window_token,
    )
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import (
        WINDOW_TOKEN_SPEC,
        Dsv41Error,
        import_dsv41,
        require_dsv41,
        window_token,
    )

dsv41_refs = import_dsv41("dsv41.harness.refs")
dsv41_rank_metrics = import_dsv41("dsv41.harness.rank_metrics")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            endpoint=dict(type="str", required=True),
            path=dict(type="path", required=True),
            mode=dict(type="str", default="auto", choices=["auto", "record", "verify"]),
            max_tokens=dict(type="int", default=16, no_log=False),  # a token count, not a secret
            timeout=dict(type="float", default=120.0),
            metrics_url=dict(type="str"),
            rank_metrics=dict(type="dict"),
            metrics_prefix=dict(type="str", default="dsv41_engram_"),
            require_ranks=dict(type="list", elements="str", default=[]),
            require_drafter=dict(type="bool", default=False),
            attempts=dict(type="int", default=1),
            delay=dict(type="float", default=2.0),
            **WINDOW_TOKEN_SPEC,
        ),
        required_if=[("require_drafter", True, ("metrics_url", "rank_metrics"), True)],
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    try:
        metrics = dsv41_rank_metrics.urls(p["rank_metrics"]) if p["rank_metrics"] else p["metrics_url"]
        with window_token(module):
            res = dsv41_refs.check(
                p["endpoint"],
                p["path"],
                mode=p["mode"],
                max_tokens=p["max_tokens"],
                timeout_s=p["timeout"],
                metrics_url=metrics,
                metrics_prefix=p["metrics_prefix"],
                require_ranks=p["require_ranks"],
                require_drafter=p["require_drafter"],
                attempts=p["attempts"],
                delay_s=p["delay"],
                write=not module.check_mode,
            )
    except Dsv41Error as exc:
        module.fail_json(msg=str(exc), endpoint=p["endpoint"], path=p["path"])
    result = dict(changed=res.action == "recorded", **res.to_dict())
    msg = res.message(p["path"])
    if msg:
        module.fail_json(msg=msg, **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
