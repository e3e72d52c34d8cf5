#!/usr/bin/python
# -*- coding: utf-8 -*-
# Apache License 2.0
"""Ansible module: check the direct links (netdev MTU, up, address; verbs MTU and RoCE v2 GID)."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_link
short_description: Check the direct offload links of a dsv41 host (netdev and RDMA verbs)
description:
  - For each link interface, checks that it exists, is up, has the expected Ethernet MTU and
    carries the expected IPv4 address.
  - Where an RDMA device is bound to the interface (C(/sys/class/infiniband/*/ports/*/gid_attrs/ndevs)),
    also checks the active verbs MTU of that port and that a RoCE v2 GID exists for the
    interface (the one matching the address when there is one).
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
    - {name: ofl0, mtu: 9000, up: true, addresses: [198.18.1.2], rdma: "no RDMA device"}
    - {name: enp1s0f1np1, mtu: 9000, up: true, addresses: [10.77.0.2], rdma: {device: mlx5_1, port: 1,
       active_mtu: 4096, gid_index: 3, gid: "0000:0000:0000:0000:0000:ffff:0a4d:0002"}}
"""

import glob
import json
import os

from ansible.module_utils.basic import AnsibleModule

IFF_UP = 0x1


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _addresses(module, name):
    """IPv4 addresses of ``name`` via ``ip -j -4 addr show dev NAME``."""
    rc, out, err = module.run_command(["ip", "-j", "-4", "addr", "show", "dev", name])
    if rc != 0:
        return []
    try:
        data = json.loads(out or "[]")
    except ValueError:
        return []
    return [a.get("local") for d in data for a in d.get("addr_info", []) if a.get("family") == "inet"]


def _gid_for_ipv4(addr):
    """RoCE v2 GID text of an IPv4 address (IPv4-mapped IPv6, sysfs formatting)."""
    parts = [int(x) for x in addr.split(".")]
    return "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x" % tuple(parts)


def _rdma_port(sysfs, name):
    """(device, port, [gid indices]) whose gid_attrs/ndevs name ``name``, or None."""
    for ndev in sorted(glob.glob(os.path.join(sysfs, "class/infiniband/*/ports/*/gid_attrs/ndevs/*"))):
        if _read(ndev) == name:
            port_dir = os.path.dirname(os.path.dirname(os.path.dirname(ndev)))
            dev = os.path.basename(os.path.dirname(os.path.dirname(port_dir)))
            idx = [os.path.basename(p) for p in glob.glob(os.path.join(port_dir, "gid_attrs/ndevs/*"))
                   if _read(p) == name]
            return dev, os.path.basename(port_dir), port_dir, sorted(idx, key=int)
    return None


def check_link(module, link, sysfs, require_verbs, verbs_mtu):
    """Return (info dict, list of error strings) for one link."""
    name = link["name"]
    errors = []
    net = os.path.join(sysfs, "class/net", name)
    if not os.path.isdir(net):
        return {"name": name}, ["%s: no such interface" % name]
    mtu = int(_read(os.path.join(net, "mtu")) or 0)
    flags = int(_read(os.path.join(net, "flags")) or "0", 16)
    up = bool(flags & IFF_UP) and _read(os.path.join(net, "operstate")) in ("up", "unknown")
    addrs = _addresses(module, name)
    info = {"name": name, "mtu": mtu, "up": up, "addresses": addrs}
    if mtu != link["mtu"]:
        errors.append("%s: MTU %d, expected %d" % (name, mtu, link["mtu"]))
    if not up:
        errors.append("%s: link is down" % name)
    if link.get("address") and link["address"] not in addrs:
        errors.append("%s: address %s missing (has %s)" % (name, link["address"], ", ".join(addrs) or "none"))
    port = _rdma_port(sysfs, name)
    if port is None:
        info["rdma"] = "no RDMA device"
        if require_verbs:
            errors.append("%s: no RDMA device bound to the interface" % name)
        return info, errors
    dev, pnum, port_dir, indices = port
    active = _read(os.path.join(port_dir, "active_mtu")) or ""
    active_mtu = int(active.split()[0]) if active.split() and active.split()[0].isdigit() else 0
    rdma = {"device": dev, "port": int(pnum), "active_mtu": active_mtu}
    if active_mtu != verbs_mtu:
        errors.append("%s: %s port %s active verbs MTU %d, expected %d" % (name, dev, pnum, active_mtu, verbs_mtu))
    v2 = [i for i in indices if (_read(os.path.join(port_dir, "gid_attrs/types", i)) or "").lower() == "roce v2"]
    want_gid = _gid_for_ipv4(link["address"]) if link.get("address") else None
    chosen = None
    for i in v2:
        gid = _read(os.path.join(port_dir, "gids", i))
        if want_gid is None or gid == want_gid:
            chosen = (i, gid)
            break
    if chosen is None:
        errors.append("%s: %s port %s has no RoCE v2 GID%s" % (
            name, dev, pnum, " for %s" % link["address"] if want_gid else ""))
    else:
        rdma.update(gid_index=int(chosen[0]), gid=chosen[1])
    info["rdma"] = rdma
    return info, errors


def main():
    module = AnsibleModule(
        argument_spec=dict(
            links=dict(type="list", elements="dict", required=True, options=dict(
                name=dict(type="str", required=True),
                mtu=dict(type="int", default=9000),
                address=dict(type="str"),
                # inventory fields of dsv41_links, accepted so the list can be passed as is
                purpose=dict(type="str"),
                prefix=dict(type="int"),
                peer=dict(type="str"),
                peer_if=dict(type="str"),
                peer_address=dict(type="str"),
            )),
            require_verbs=dict(type="bool", default=True),
            verbs_mtu=dict(type="int", default=4096),
            sysfs=dict(type="path", default="/sys"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    infos, errors = [], []
    for link in p["links"]:
        info, errs = check_link(module, link, p["sysfs"], p["require_verbs"], p["verbs_mtu"])
        infos.append(info)
        errors.extend(errs)
    if errors:
        module.fail_json(msg="; ".join(errors), links=infos)
    module.exit_json(changed=False, links=infos)


if __name__ == "__main__":
    main()
