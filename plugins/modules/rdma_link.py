#!/usr/bin/python
# Apache License 2.0
"""Ansible module: check the direct links (netdev MTU, up, address; RDMA port state, verbs MTU and RoCE v2
GID through pyverbs or sysfs). The logic is ``dsv41.harness.links``."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_link
short_description: Check the direct offload links of a dsv41 host (netdev and RDMA verbs)
description:
  - For each link interface, checks that it exists, is up, has the expected Ethernet MTU and
    carries the expected IPv4 address.
  - Where an RDMA device is bound to the interface, also checks that its port is ACTIVE, the
    active verbs MTU of that port and that a RoCE v2 GID exists for the interface (the one
    matching the address when there is one).
  - The verbs facts come from rdma-core's Python binding pyverbs (C(ibv_query_port),
    C(ibv_query_gid_table)) when it can be imported by the module's interpreter, else from sysfs
    (C(/sys/class/infiniband/*/ports/*)); the result says which (C(rdma_source)).
  - Check-only; never changes anything. Mismatches fail naming the interface and both values.
options:
  links:
    description: Links to check.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description: Interface name.
        type: str
        required: true
      mtu:
        description: Expected Ethernet MTU.
        type: int
        default: 9000
      address:
        description: Expected IPv4 address on the interface (no prefix); omit to skip.
        type: str
      purpose:
        description: Inventory field (C(offload) or C(fabric)); not checked.
        type: str
      prefix:
        description: Inventory field (prefix length); not checked.
        type: int
      peer:
        description: Inventory field (peer host); not checked.
        type: str
      peer_if:
        description: Inventory field (peer interface); not checked.
        type: str
      peer_address:
        description: Inventory field (peer address); not checked.
        type: str
  require_verbs:
    description:
      - Fail when no RDMA device is bound to an interface. V(false) (the lab) reports
        C(no RDMA device) for it instead.
    type: bool
    default: true
  verbs_mtu:
    description: Expected active verbs MTU in bytes.
    type: int
    default: 4096
  sysfs:
    description: Root of sysfs (tests point it at a fake tree).
    type: path
    default: /sys
  rdma_source:
    description:
      - Where the verbs facts come from. V(auto) uses pyverbs when it can be imported, sysfs
        otherwise; V(pyverbs) fails when pyverbs cannot be imported; V(sysfs) never imports it.
    type: str
    choices: [auto, pyverbs, sysfs]
    default: auto
attributes:
  check_mode:
    support: full
    description: The module only reads, so check mode behaves like a normal run.
  diff_mode:
    support: none
    description: Nothing is changed, so there is nothing to diff.
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Check the offload link of a Spark
  rdma_link:
    links:
      - {name: enp1s0f1np1, mtu: 9000, address: 10.77.0.2}
    verbs_mtu: 4096
"""

RETURN = r"""
links:
  description: Per interface, what was found.
  returned: always
  type: list
  elements: dict
  sample:
    - {name: ofl0, exists: true, mtu: 9000, up: true, operstate: up, addresses: [198.18.1.2],
       rdma_source: pyverbs, rdma: "no RDMA device"}
    - {name: enp1s0f1np1, exists: true, mtu: 9000, up: true, operstate: up, addresses: [10.77.0.2],
       rdma_source: pyverbs, rdma: {device: mlx5_1, port: 1, state: ACTIVE, active_mtu: 4096, gid_index: 3,
       gid: "0000:0000:0000:0000:0000:ffff:0a4d:0002"}}
checks:
  description: One entry per link and check (netdev, up, mtu, address, rdma_port, rdma_active_mtu,
    roce_v2_gid) with the value read, the expected value, C(ok) (true, false, or null when skipped)
    and the reason; what C(dsv41 qualify) puts in its report.
  returned: always
  type: list
  elements: dict
rdma_source:
  description: Where the verbs facts came from, C(pyverbs) or C(sysfs).
  returned: always
  type: str
  sample: pyverbs
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import import_dsv41, require_dsv41
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import import_dsv41, require_dsv41

links_mod = import_dsv41("dsv41.harness.links")


def _netdev(module):
    """An interface's MTU, flags and operstate through ``module.run_command`` (``ip -j link``), for
    a ``/sys`` of another network namespace (links.ip_link_facts parses it)."""

    def read(name):
        rc, out, dummy = module.run_command(["ip", "-j", "link", "show", "dev", name])
        return links_mod.ip_link_facts(name, out) if rc == 0 else None

    return read


def _addresses(module):
    """IPv4 addresses of an interface through ``module.run_command`` (``ip -j -4 addr``)."""
    import json

    def read(name):
        rc, out, dummy = module.run_command(["ip", "-j", "-4", "addr", "show", "dev", name])
        if rc != 0:
            return []
        try:
            data = json.loads(out or "[]")
        except ValueError:
            return []
        return [a.get("local") for d in data for a in d.get("addr_info", []) if a.get("family") == "inet"]

    return read


def main():
    module = AnsibleModule(
        argument_spec=dict(
            links=dict(
                type="list",
                elements="dict",
                required=True,
                options=dict(
                    name=dict(type="str", required=True),
                    mtu=dict(type="int", default=9000),
                    address=dict(type="str"),
                    # inventory fields of dsv41_links, accepted so the list can be passed as is
                    purpose=dict(type="str"),
                    prefix=dict(type="int"),
                    peer=dict(type="str"),
                    peer_if=dict(type="str"),
                    peer_address=dict(type="str"),
                ),
            ),
            require_verbs=dict(type="bool", default=True),
            verbs_mtu=dict(type="int", default=4096),
            sysfs=dict(type="path", default="/sys"),
            rdma_source=dict(type="str", default="auto", choices=["auto", "pyverbs", "sysfs"]),
        ),
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    verbs = "auto"
    if p["rdma_source"] == "sysfs":
        verbs = None
    elif p["rdma_source"] == "pyverbs":
        verbs = links_mod.load_pyverbs()
        if verbs is None:
            module.fail_json(msg=missing_required_lib("pyverbs"))
    infos, checks, errors = links_mod.check_links(
        p["links"],
        sysfs=p["sysfs"],
        require_verbs=p["require_verbs"],
        verbs_mtu=p["verbs_mtu"],
        pyverbs=verbs,
        addresses=_addresses(module),
        netdev=_netdev(module),
    )
    source = next(
        (i["rdma_source"] for i in infos if i.get("rdma_source")),
        "sysfs" if verbs is None else "pyverbs" if links_mod.load_pyverbs() else "sysfs",
    )
    if errors:
        module.fail_json(msg="; ".join(errors), links=infos, checks=checks, rdma_source=source)
    module.exit_json(changed=False, links=infos, checks=checks, rdma_source=source)


if __name__ == "__main__":
    main()
