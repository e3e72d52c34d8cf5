"""The direct links of a host: netdev state from sysfs (netlink, ``ip -j link``, when ``/sys`` is
another network namespace's), RDMA port state through pyverbs or sysfs.

What ``rdma_link`` (plugins/modules) and ``dsv41 qualify`` read for each link of
``dsv41_links``: the interface exists, is up, has the expected Ethernet MTU and IPv4 address; where
an RDMA device is bound to the interface, its port is ACTIVE with the expected active verbs MTU and
a RoCE v2 GID for the link address.

The verbs side comes from rdma-core's Python binding ``pyverbs`` (``ibv_get_device_list``,
``ibv_query_port``, ``ibv_query_gid_table``: rdma-core's ``libibverbs`` man pages) when it can be
imported, else from the kernel's sysfs files the same library reads
(``/sys/class/infiniband/<dev>/ports/<p>/{state,active_mtu,gids,gid_attrs}``). Every result says
which source it read (``rdma_source``: ``pyverbs`` or ``sysfs``). Stdlib only, plus the optional
pyverbs import.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import socket
import subprocess
from collections.abc import Callable
from typing import Any

from dsv41 import fileio

IFF_UP = 0x1
#: enum ibv_port_state (infiniband/verbs.h): IBV_PORT_ACTIVE.
IBV_PORT_ACTIVE = 4
#: enum ibv_mtu (verbs.h): IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5; bytes = 128 << value.
#: enum ibv_gid_type of struct ibv_gid_entry (verbs.h): IB = 0, RoCE v1 = 1, RoCE v2 = 2.
IBV_GID_TYPE_ROCE_V2 = 2
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}


def _read(path: str) -> str | None:
    """A sysfs attribute's text, stripped; None when it is absent or unreadable."""
    try:
        return fileio.read_text(path, "a sysfs attribute").strip()
    except (OSError, fileio.FileError):
        return None


def gid_for_ipv4(addr: str) -> str:
    """RoCE v2 GID text of an IPv4 address: the IPv4-mapped IPv6 address (RFC 4291 2.5.5.2) in
    the kernel's sysfs / pyverbs ``gid_str`` format (eight 4-digit hex groups).
    ValueError for text that is not an IPv4 address."""
    packed = ipaddress.IPv4Address(addr).packed
    return "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}".format(*tuple(packed))


def ipv4_addresses(name: str, run: Callable[..., Any] = subprocess.run) -> list[str]:
    """IPv4 addresses of interface ``name`` (``ip -j -4 addr show dev NAME``); [] when none or
    when ``ip`` fails."""
    try:
        r = run(
            ["ip", "-j", "-4", "addr", "show", "dev", name], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if r.returncode != 0:
        return []
    try:
        data = fileio.loads_json(r.stdout or "[]")
    except ValueError:
        return []
    return [a.get("local") for d in data for a in d.get("addr_info", []) if a.get("family") == "inet"]


def ip_link_facts(name: str, text: str) -> dict | None:
    """``{"mtu": int, "flags": int (IFF_UP only), "operstate": str}`` of ``name`` from the JSON
    ``ip -j link show dev NAME`` prints; None when it does not describe ``name``."""
    try:
        data = fileio.loads_json(text or "[]")
    except ValueError:
        return None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or data[0].get("ifname") != name:
        return None
    d = data[0]
    return {
        "mtu": int(d.get("mtu") or 0),
        "flags": IFF_UP if "UP" in (d.get("flags") or []) else 0,
        "operstate": str(d.get("operstate", "")).lower(),
    }


def ip_link(name: str, run: Callable[..., Any] = subprocess.run) -> dict | None:
    """:func:`ip_link_facts` of interface ``name`` in this process's network namespace, over
    netlink (``ip -j link show dev NAME``); None when there is no such interface or ``ip`` fails.
    The fallback for a ``/sys`` that belongs to another network namespace: a container joined to a
    network namespace while ``/sys`` stayed the host's (systemd-nspawn ``--network-namespace-path``
    bind-mounts the host's ``/sys``; docs/lab.md)."""
    try:
        r = run(["ip", "-j", "link", "show", "dev", name], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return ip_link_facts(name, r.stdout) if r.returncode == 0 else None


def load_pyverbs():
    """The ``pyverbs.device`` module, or None when pyverbs (or its libibverbs) cannot be imported."""
    try:
        import pyverbs.device as device  # rdma-core's binding; optional
    except (ImportError, OSError):
        return None
    return device


def _name(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def verbs_ports_pyverbs(device_mod: Any, ifindex: int) -> tuple[list[dict], str | None]:
    """RDMA ports whose GID table has entries bound to netdev ``ifindex``, read through pyverbs.

    Returns ``([{"device", "port", "state", "active_mtu" (bytes), "gids": [{"index", "gid",
    "type"}]}], error)``; ``error`` is a one-line reason when the device list cannot be read
    (e.g. no verbs support in the kernel), else None. A host without RDMA devices gives ``([], None)``.
    """
    from pyverbs.pyverbs_error import PyverbsError  # noqa: PLC0415 - only with pyverbs present

    try:
        devs = device_mod.get_device_list()
    except PyverbsError as exc:
        return [], f"pyverbs: {exc}"
    out = []
    for dev in devs:
        name = _name(dev.name)
        try:
            ctx = device_mod.Context(name=name)
        except PyverbsError as exc:
            return out, f"pyverbs: cannot open {name}: {exc}"
        try:
            nports = ctx.query_device().phys_port_cnt
            entries = []
            for p in range(1, nports + 1):
                entries.append(ctx.query_port(p).gid_tbl_len)
            table = ctx.query_gid_table(max(1, sum(entries)))
            mine = [e for e in table if e.ndev_ifindex == ifindex]
            for p in sorted({e.port_num for e in mine}):
                attr = ctx.query_port(p)
                out.append(
                    {
                        "device": name,
                        "port": int(p),
                        "state": _PORT_STATES.get(int(attr.state), str(attr.state)),
                        "active_mtu": 128 << int(attr.active_mtu),
                        "gids": [
                            {
                                "index": int(e.gid_index),
                                "gid": e.gid_str(),
                                "type": "RoCE v2" if int(e.gid_type) == IBV_GID_TYPE_ROCE_V2 else "other",
                            }
                            for e in mine
                            if e.port_num == p
                        ],
                    }
                )
        except PyverbsError as exc:
            return out, f"pyverbs: {name}: {exc}"
        finally:
            ctx.close()
    return out, None


def verbs_ports_sysfs(sysfs: str, name: str) -> list[dict]:
    """The same as :func:`verbs_ports_pyverbs` from sysfs: ports whose
    ``gid_attrs/ndevs/<i>`` names ``name``."""
    out = []
    for port_dir in sorted(glob.glob(os.path.join(sysfs, "class/infiniband/*/ports/*"))):
        idx = sorted(
            (os.path.basename(p) for p in glob.glob(os.path.join(port_dir, "gid_attrs/ndevs/*")) if _read(p) == name),
            key=int,
        )
        if not idx:
            continue
        state = (_read(os.path.join(port_dir, "state")) or "").split(":")[-1].strip()  # "4: ACTIVE"
        active = (_read(os.path.join(port_dir, "active_mtu")) or "").split()  # "4096 (5)"
        out.append(
            {
                "device": os.path.basename(os.path.dirname(os.path.dirname(port_dir))),
                "port": int(os.path.basename(port_dir)),
                "state": state or "unknown",
                "active_mtu": int(active[0]) if active and active[0].isdigit() else 0,
                "gids": [
                    {
                        "index": int(i),
                        "gid": _read(os.path.join(port_dir, "gids", i)) or "",
                        "type": "RoCE v2"
                        if (_read(os.path.join(port_dir, "gid_attrs/types", i)) or "").lower() == "roce v2"
                        else "other",
                    }
                    for i in idx
                ],
            }
        )
    return out


def check_link(
    link: dict,
    *,
    sysfs: str = "/sys",
    require_verbs: bool = True,
    verbs_mtu: int = 4096,
    pyverbs: Any = "auto",
    addresses: Callable[[str], list[str]] = ipv4_addresses,
    netdev: Callable[[str], dict | None] = ip_link,
) -> tuple[dict, list[dict]]:
    """Read one link and judge it.

    ``link``: an entry of ``dsv41_links`` (``name``, ``mtu`` (default 9000), optional ``address``).
    ``pyverbs``: the ``pyverbs.device`` module, None (read sysfs), or ``"auto"`` (import it when
    possible). ``netdev``: the interface's facts when ``sysfs`` has no entry for it (:func:`ip_link`,
    netlink: a ``/sys`` of another network namespace). Returns ``(info, checks)``: ``info`` the values read (``rdma_source`` says which
    source the verbs facts came from); ``checks`` one dict per check ``{"check", "ok" (True, False
    or None = skipped), "value", "expected", "reason"}`` with check names ``netdev``, ``up``,
    ``mtu``, ``address``, ``rdma_port``, ``rdma_active_mtu``, ``roce_v2_gid``.
    """
    name = link["name"]
    want_mtu = int(link.get("mtu") or 9000)
    net = os.path.join(sysfs, "class/net", name)
    checks: list[dict] = []

    def add(check, ok, value=None, expected=None, reason=""):
        checks.append({"check": check, "ok": ok, "value": value, "expected": expected, "reason": reason})

    if os.path.isdir(net):
        mtu = int(_read(os.path.join(net, "mtu")) or 0)
        flags = int(_read(os.path.join(net, "flags")) or "0", 16)
        oper = _read(os.path.join(net, "operstate"))
    else:
        nl = netdev(name)
        if nl is None:
            add("netdev", False, "absent", "present", f"{name}: no such interface")
            return {"name": name, "exists": False}, checks
        mtu, flags, oper = nl["mtu"], nl["flags"], nl["operstate"]
    add("netdev", True, "present", "present")
    up = bool(flags & IFF_UP) and oper in ("up", "unknown")
    addrs = addresses(name)
    info: dict = {"name": name, "exists": True, "mtu": mtu, "up": up, "operstate": oper, "addresses": addrs}
    add("up", up, oper if up or not oper else f"{oper} (flags {flags:#x})", "up", "" if up else f"{name}: link is down")
    add("mtu", mtu == want_mtu, mtu, want_mtu, "" if mtu == want_mtu else f"{name}: MTU {mtu}, expected {want_mtu}")
    if link.get("address"):
        ok = link["address"] in addrs
        add(
            "address",
            ok,
            addrs,
            link["address"],
            "" if ok else f"{name}: address {link['address']} missing (has {', '.join(addrs) or 'none'})",
        )
    dev = load_pyverbs() if pyverbs == "auto" else pyverbs
    ports, verr = [], None
    if dev is not None:
        info["rdma_source"] = "pyverbs"
        try:
            ifindex = socket.if_nametoindex(name)
        except OSError:
            ifindex = -1
        ports, verr = verbs_ports_pyverbs(dev, ifindex)
    else:
        info["rdma_source"] = "sysfs"
        ports = verbs_ports_sysfs(sysfs, name)
    src = info["rdma_source"]
    if not ports:
        info["rdma"] = "no RDMA device"
        if verr:
            info["rdma_error"] = verr
        reason = f"{name}: no RDMA device bound to the interface ({verr or src})"
        for check in ("rdma_port", "rdma_active_mtu", "roce_v2_gid"):
            add(check, False if require_verbs else None, None, None, reason)
        return info, checks
    port = ports[0]
    info["rdma"] = {
        "device": port["device"],
        "port": port["port"],
        "state": port["state"],
        "active_mtu": port["active_mtu"],
    }
    where = f"{name}: {port['device']} port {port['port']}"
    active = port["state"] == "ACTIVE"
    add("rdma_port", active, port["state"], "ACTIVE", "" if active else f"{where} is {port['state']}")
    ok = port["active_mtu"] == verbs_mtu
    add(
        "rdma_active_mtu",
        ok,
        port["active_mtu"],
        verbs_mtu,
        "" if ok else f"{where} active verbs MTU {port['active_mtu']}, expected {verbs_mtu}",
    )
    want_gid = gid_for_ipv4(link["address"]) if link.get("address") else None
    v2 = [g for g in port["gids"] if g["type"] == "RoCE v2" and (want_gid is None or g["gid"] == want_gid)]
    if v2:
        info["rdma"].update(gid_index=v2[0]["index"], gid=v2[0]["gid"])
    add(
        "roce_v2_gid",
        bool(v2),
        v2[0]["gid"] if v2 else [g["gid"] for g in port["gids"]],
        want_gid or "any RoCE v2",
        "" if v2 else f"{where} has no RoCE v2 GID" + (f" for {link['address']}" if want_gid else ""),
    )
    return info, checks


def check_links(links: list[dict], **kw) -> tuple[list[dict], list[dict], list[str]]:
    """:func:`check_link` over ``links``; returns ``(infos, checks with "link" added, error lines)``
    where the error lines are the reasons of the failed checks (skipped ones are not errors)."""
    infos, checks, errors = [], [], []
    for link in links:
        info, cs = check_link(link, **kw)
        infos.append(info)
        for c in cs:
            c["link"] = link["name"]
            c["rdma_source"] = info.get("rdma_source")
            checks.append(c)
            if c["ok"] is False and c["reason"] not in errors:
                errors.append(c["reason"])
    return infos, checks, errors
