"""plugins/modules/rdma_link.py (logic: dsv41.harness.links): MTU, up, address, RDMA port state, verbs
MTU, RoCE v2 GID, and which source the verbs facts came from.

- sysfs: a fake sysfs tree (``rdma_source: sysfs``);
- pyverbs installed on this machine, which has no RDMA device: the no-device path through the real
  binding (``ibv_get_device_list`` fails or lists nothing);
- the device path through pyverbs: a fake of the pyverbs objects (``get_device_list``, ``Context``,
  ``query_device``, ``query_port``, ``query_gid_table``, ``GIDEntry``).
"""

from __future__ import annotations

import json

import pytest
from ansible_collections.dsv41.offload.plugins.modules import rdma_link  # noqa: E402


def _netdev(sysfs, name, mtu=9000, up=True):
    d = sysfs / "class/net" / name
    d.mkdir(parents=True)
    (d / "mtu").write_text(f"{mtu}\n")
    (d / "flags").write_text("0x1003\n" if up else "0x1002\n")
    (d / "operstate").write_text("up\n" if up else "down\n")


_GIDS = (("RoCE v1", "fe80:0000:0000:0000:0000:0000:0000:0001"), ("RoCE v2", "0000:0000:0000:0000:0000:ffff:0a4d:0002"))


def _rdma(sysfs, dev, ndev, active_mtu="4096 (5)", gids=_GIDS, state="4: ACTIVE"):
    port = sysfs / "class/infiniband" / dev / "ports/1"
    for sub in ("gid_attrs/ndevs", "gid_attrs/types", "gids"):
        (port / sub).mkdir(parents=True, exist_ok=True)
    (port / "active_mtu").write_text(active_mtu + "\n")
    (port / "state").write_text(state + "\n")
    for i, (typ, gid) in enumerate(gids):
        (port / "gid_attrs/ndevs" / str(i)).write_text(ndev + "\n")
        (port / "gid_attrs/types" / str(i)).write_text(typ + "\n")
        (port / "gids" / str(i)).write_text(gid + "\n")


@pytest.fixture
def ip_addrs(monkeypatch):
    """Fake `ip -j -4 addr show dev X` answers from a dict name -> [addresses]."""
    from ansible.module_utils import basic

    table = {}

    def run_command(self, args, **kw):
        name = args[-1]
        if name not in table:
            return 1, "", "Device does not exist"
        return (
            0,
            json.dumps(
                [{"ifname": name, "addr_info": [{"family": "inet", "local": a, "prefixlen": 30} for a in table[name]]}]
            ),
            "",
        )

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    return table


def test_lab_link_without_verbs_reports_no_rdma_device(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "ofl0")
    ip_addrs["ofl0"] = ["198.18.1.2"]
    kind, res = run_module(
        rdma_link,
        {
            "links": [{"name": "ofl0", "address": "198.18.1.2"}],
            "require_verbs": False,
            "sysfs": str(tmp_path),
            "rdma_source": "sysfs",
        },
    )
    assert kind == "exit" and not res["changed"] and res["rdma_source"] == "sysfs"
    assert res["links"] == [
        {
            "name": "ofl0",
            "exists": True,
            "mtu": 9000,
            "up": True,
            "operstate": "up",
            "addresses": ["198.18.1.2"],
            "rdma_source": "sysfs",
            "rdma": "no RDMA device",
        }
    ]
    by = {c["check"]: c for c in res["checks"]}
    assert [by[k]["ok"] for k in ("netdev", "up", "mtu", "address")] == [True] * 4
    assert [by[k]["ok"] for k in ("rdma_port", "rdma_active_mtu", "roce_v2_gid")] == [None] * 3  # skipped, with why
    assert by["rdma_port"]["reason"] == "ofl0: no RDMA device bound to the interface (sysfs)"


def test_require_verbs_fails_without_device(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "ofl0")
    ip_addrs["ofl0"] = []
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0"}], "sysfs": str(tmp_path), "rdma_source": "sysfs"})
    assert kind == "fail" and res["msg"] == "ofl0: no RDMA device bound to the interface (sysfs)"


def test_mtu_down_and_address_mismatches_name_interface_and_values(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "ofl0", mtu=1500, up=False)
    ip_addrs["ofl0"] = ["198.18.9.9"]
    kind, res = run_module(
        rdma_link,
        {
            "links": [{"name": "ofl0", "address": "198.18.1.2"}, {"name": "nope"}],
            "require_verbs": False,
            "sysfs": str(tmp_path),
            "rdma_source": "sysfs",
        },
    )
    assert kind == "fail"
    assert "ofl0: MTU 1500, expected 9000" in res["msg"] and "ofl0: link is down" in res["msg"]
    assert "ofl0: address 198.18.1.2 missing (has 198.18.9.9)" in res["msg"] and "nope: no such interface" in res["msg"]


def test_verbs_mtu_and_roce_v2_gid(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.2"]
    _rdma(tmp_path, "mlx5_1", "enp1s0f1np1")
    kind, res = run_module(
        rdma_link,
        {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.2"}], "sysfs": str(tmp_path), "rdma_source": "sysfs"},
    )
    assert kind == "exit" and res["rdma_source"] == "sysfs"
    assert res["links"][0]["rdma"] == {
        "device": "mlx5_1",
        "port": 1,
        "state": "ACTIVE",
        "active_mtu": 4096,
        "gid_index": 1,
        "gid": "0000:0000:0000:0000:0000:ffff:0a4d:0002",
    }


def test_verbs_mtu_mismatch_and_missing_v2_gid(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.3"]
    _rdma(tmp_path, "mlx5_1", "enp1s0f1np1", active_mtu="1024 (3)", state="1: DOWN")
    kind, res = run_module(
        rdma_link,
        {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.3"}], "sysfs": str(tmp_path), "rdma_source": "sysfs"},
    )
    assert kind == "fail"
    assert "enp1s0f1np1: mlx5_1 port 1 is DOWN" in res["msg"]
    assert "enp1s0f1np1: mlx5_1 port 1 active verbs MTU 1024, expected 4096" in res["msg"]
    assert "has no RoCE v2 GID for 10.77.0.3" in res["msg"]


def test_links_required(run_module):
    kind, res = run_module(rdma_link, {})
    assert kind == "fail" and "links" in res["msg"]


# --- pyverbs -----------------------------------------------------------------------------------------


def test_pyverbs_installed_on_a_host_without_rdma_devices(tmp_path, ip_addrs, run_module):
    """The real binding (constraints.txt pins it), on this machine: no RDMA device. auto and
    pyverbs read through it and say so; no device is skipped on the lab and fails in production."""
    pytest.importorskip("pyverbs.device")
    _netdev(tmp_path, "ofl0")
    ip_addrs["ofl0"] = ["198.18.1.2"]
    for source in ("auto", "pyverbs"):
        kind, res = run_module(
            rdma_link,
            {
                "links": [{"name": "ofl0", "address": "198.18.1.2"}],
                "require_verbs": False,
                "sysfs": str(tmp_path),
                "rdma_source": source,
            },
        )
        assert kind == "exit" and res["rdma_source"] == "pyverbs", res
        assert res["links"][0]["rdma"] == "no RDMA device" and res["links"][0]["rdma_error"].startswith("pyverbs: ")
        assert {c["check"]: c["ok"] for c in res["checks"]}["rdma_port"] is None
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0", "address": "198.18.1.2"}], "sysfs": str(tmp_path)})
    assert kind == "fail" and res["rdma_source"] == "pyverbs"
    assert res["msg"].startswith("ofl0: no RDMA device bound to the interface (pyverbs")


def test_rdma_source_pyverbs_without_the_binding_fails_naming_it(tmp_path, ip_addrs, run_module, monkeypatch):
    monkeypatch.setattr(rdma_link.links_mod, "load_pyverbs", lambda: None)
    _netdev(tmp_path, "ofl0")
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0"}], "sysfs": str(tmp_path), "rdma_source": "pyverbs"})
    assert kind == "fail" and "pyverbs" in res["msg"]
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0"}], "require_verbs": False, "sysfs": str(tmp_path)})
    assert kind == "exit" and res["rdma_source"] == "sysfs"  # auto falls back to sysfs


class _Entry:
    """pyverbs.device.GIDEntry's read side."""

    def __init__(self, index, port, gid_type, ifindex, gid):
        self.gid_index, self.port_num, self.gid_type, self.ndev_ifindex, self._gid = index, port, gid_type, ifindex, gid

    def gid_str(self):
        return self._gid


class _FakeVerbs:
    """A fake ``pyverbs.device``: one device, one port, a GID table (types: 1 = RoCE v1, 2 = RoCE v2)."""

    def __init__(self, ifindex, state=4, mtu_enum=5, entries=None):
        outer = self

        class Dev:
            name = b"mlx5_1"

        class Attr:
            phys_port_cnt = 1

        class PortAttr:
            def __init__(self):
                self.state, self.active_mtu, self.gid_tbl_len = outer.state, outer.mtu_enum, 8

        class Context:
            def __init__(self, name):
                assert name == "mlx5_1"
                outer.opened.append(name)

            def query_device(self):
                return Attr()

            def query_port(self, p):
                assert p == 1
                return PortAttr()

            def query_gid_table(self, n):
                return list(outer.entries)[:n]

            def close(self):
                outer.closed += 1

        self.state, self.mtu_enum, self.opened, self.closed = state, mtu_enum, [], 0
        self.entries = (
            entries
            if entries is not None
            else [
                _Entry(0, 1, 1, ifindex, "fe80:0000:0000:0000:0000:0000:0000:0001"),
                _Entry(1, 1, 2, ifindex, "0000:0000:0000:0000:0000:ffff:0a4d:0002"),
                _Entry(2, 1, 2, ifindex + 1, "0000:0000:0000:0000:0000:ffff:0a4d:0009"),
            ]
        )  # another netdev
        self.Context = Context
        self.get_device_list = lambda: [Dev()]


@pytest.fixture
def fake_verbs(monkeypatch):
    pytest.importorskip("pyverbs.pyverbs_error")  # the fake raises nothing, but the reader imports the error type
    import socket as _socket

    monkeypatch.setattr(_socket, "if_nametoindex", lambda name: {"enp1s0f1np1": 7}[name])

    def make(**kw):
        fv = _FakeVerbs(7, **kw)
        monkeypatch.setattr(rdma_link.links_mod, "load_pyverbs", lambda: fv)
        return fv

    return make


def test_pyverbs_device_path_active_mtu_and_roce_v2_gid(tmp_path, ip_addrs, run_module, fake_verbs):
    fv = fake_verbs()
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.2"]
    kind, res = run_module(
        rdma_link, {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.2"}], "sysfs": str(tmp_path)}
    )
    assert kind == "exit", res
    assert res["rdma_source"] == "pyverbs" and res["links"][0]["rdma_source"] == "pyverbs"
    assert res["links"][0]["rdma"] == {
        "device": "mlx5_1",
        "port": 1,
        "state": "ACTIVE",
        "active_mtu": 4096,
        "gid_index": 1,
        "gid": "0000:0000:0000:0000:0000:ffff:0a4d:0002",
    }
    assert fv.opened == ["mlx5_1"] and fv.closed == 1
    assert all(c["ok"] for c in res["checks"])


def test_pyverbs_device_path_port_down_mtu_1024_and_no_v2_gid_for_the_address(
    tmp_path, ip_addrs, run_module, fake_verbs
):
    fake_verbs(state=1, mtu_enum=3)
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.3"]
    kind, res = run_module(
        rdma_link, {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.3"}], "sysfs": str(tmp_path)}
    )
    assert kind == "fail" and res["rdma_source"] == "pyverbs"
    assert "enp1s0f1np1: mlx5_1 port 1 is DOWN" in res["msg"]
    assert "enp1s0f1np1: mlx5_1 port 1 active verbs MTU 1024, expected 4096" in res["msg"]
    assert "enp1s0f1np1: mlx5_1 port 1 has no RoCE v2 GID for 10.77.0.3" in res["msg"]


def test_pyverbs_device_path_gids_of_another_netdev_are_not_this_link(tmp_path, ip_addrs, run_module, fake_verbs):
    fake_verbs(entries=[_Entry(0, 1, 2, 8, "0000:0000:0000:0000:0000:ffff:0a4d:0002")])  # ifindex 8, not 7
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.2"]
    kind, res = run_module(
        rdma_link, {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.2"}], "sysfs": str(tmp_path)}
    )
    assert kind == "fail" and res["msg"] == "enp1s0f1np1: no RDMA device bound to the interface (pyverbs)"


def test_every_check_name_is_reported_for_every_link(tmp_path, ip_addrs, run_module):
    """The class: each link gets every check of dsv41.harness.links (an absent netdev only 'netdev')."""
    _netdev(tmp_path, "a")
    _netdev(tmp_path, "b")
    _rdma(tmp_path, "mlx5_0", "b")
    ip_addrs.update(a=["10.0.0.1"], b=["10.77.0.2"])
    kind, res = run_module(
        rdma_link,
        {
            "links": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.77.0.2"}, {"name": "gone"}],
            "require_verbs": False,
            "sysfs": str(tmp_path),
            "rdma_source": "sysfs",
        },
    )
    names = ["netdev", "up", "mtu", "address", "rdma_port", "rdma_active_mtu", "roce_v2_gid"]
    got = {}
    for c in res["checks"]:
        got.setdefault(c["link"], []).append(c["check"])
    assert got == {"a": names, "b": names, "gone": ["netdev"]}
    assert kind == "fail" and res["msg"] == "gone: no such interface"


def test_a_sys_of_another_network_namespace_reads_the_interface_over_netlink(tmp_path, run_module, monkeypatch):
    """systemd-nspawn --network-namespace-path keeps the host's /sys: the interface is not in
    sysfs, `ip -j link` (netlink, this namespace) has it; a name neither has is still absent."""
    from ansible.module_utils import basic

    def run_command(self, args, **kw):
        name = args[-1]
        if name != "ofl0":
            return 1, "", f'Device "{name}" does not exist.'
        if args[2] == "link":
            return (
                0,
                json.dumps(
                    [{"ifname": "ofl0", "mtu": 9000, "flags": ["BROADCAST", "UP", "LOWER_UP"], "operstate": "UP"}]
                ),
                "",
            )
        return 0, json.dumps([{"ifname": "ofl0", "addr_info": [{"family": "inet", "local": "198.18.1.2"}]}]), ""

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    kind, res = run_module(
        rdma_link,
        {
            "links": [{"name": "ofl0", "mtu": 9000, "address": "198.18.1.2"}],
            "require_verbs": False,
            "sysfs": str(tmp_path),
            "rdma_source": "sysfs",
        },
    )
    assert kind == "exit", res
    assert res["links"][0] | {"rdma": None} == {
        "name": "ofl0",
        "exists": True,
        "mtu": 9000,
        "up": True,
        "operstate": "up",
        "addresses": ["198.18.1.2"],
        "rdma_source": "sysfs",
        "rdma": None,
    }
    kind, res = run_module(
        rdma_link, {"links": [{"name": "ofl9"}], "require_verbs": False, "sysfs": str(tmp_path), "rdma_source": "sysfs"}
    )
    assert kind == "fail" and res["msg"] == "ofl9: no such interface"
