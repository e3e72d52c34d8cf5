"""plugins/modules/rdma_link.py against a fake sysfs tree: MTU, up, address, verbs MTU, RoCE v2 GID."""

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


_GIDS = (("RoCE v1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
         ("RoCE v2", "0000:0000:0000:0000:0000:ffff:0a4d:0002"))


def _rdma(sysfs, dev, ndev, active_mtu="4096 (5)", gids=_GIDS):
    port = sysfs / "class/infiniband" / dev / "ports/1"
    for sub in ("gid_attrs/ndevs", "gid_attrs/types", "gids"):
        (port / sub).mkdir(parents=True, exist_ok=True)
    (port / "active_mtu").write_text(active_mtu + "\n")
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
        return 0, json.dumps([{"ifname": name, "addr_info": [{"family": "inet", "local": a, "prefixlen": 30}
                                                             for a in table[name]]}]), ""

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    return table


def test_lab_link_without_verbs_reports_no_rdma_device(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "ofl0")
    ip_addrs["ofl0"] = ["198.18.1.2"]
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0", "address": "198.18.1.2"}],
                                       "require_verbs": False, "sysfs": str(tmp_path)})
    assert kind == "exit" and not res["changed"]
    assert res["links"] == [{"name": "ofl0", "mtu": 9000, "up": True, "addresses": ["198.18.1.2"],
                             "rdma": "no RDMA device"}]


def test_require_verbs_fails_without_device(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "ofl0")
    ip_addrs["ofl0"] = []
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0"}], "sysfs": str(tmp_path)})
    assert kind == "fail" and res["msg"] == "ofl0: no RDMA device bound to the interface"


def test_mtu_down_and_address_mismatches_name_interface_and_values(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "ofl0", mtu=1500, up=False)
    ip_addrs["ofl0"] = ["198.18.9.9"]
    kind, res = run_module(rdma_link, {"links": [{"name": "ofl0", "address": "198.18.1.2"}, {"name": "nope"}],
                                       "require_verbs": False, "sysfs": str(tmp_path)})
    assert kind == "fail"
    assert "ofl0: MTU 1500, expected 9000" in res["msg"] and "ofl0: link is down" in res["msg"]
    assert "ofl0: address 198.18.1.2 missing (has 198.18.9.9)" in res["msg"] and "nope: no such interface" in res["msg"]


def test_verbs_mtu_and_roce_v2_gid(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.2"]
    _rdma(tmp_path, "mlx5_1", "enp1s0f1np1")
    kind, res = run_module(rdma_link, {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.2"}],
                                       "sysfs": str(tmp_path)})
    assert kind == "exit"
    assert res["links"][0]["rdma"] == {"device": "mlx5_1", "port": 1, "active_mtu": 4096, "gid_index": 1,
                                       "gid": "0000:0000:0000:0000:0000:ffff:0a4d:0002"}


def test_verbs_mtu_mismatch_and_missing_v2_gid(tmp_path, ip_addrs, run_module):
    _netdev(tmp_path, "enp1s0f1np1")
    ip_addrs["enp1s0f1np1"] = ["10.77.0.3"]
    _rdma(tmp_path, "mlx5_1", "enp1s0f1np1", active_mtu="1024 (3)")
    kind, res = run_module(rdma_link, {"links": [{"name": "enp1s0f1np1", "address": "10.77.0.3"}],
                                       "sysfs": str(tmp_path)})
    assert kind == "fail"
    assert "enp1s0f1np1: mlx5_1 port 1 active verbs MTU 1024, expected 4096" in res["msg"]
    assert "has no RoCE v2 GID for 10.77.0.3" in res["msg"]


def test_links_required(run_module):
    kind, res = run_module(rdma_link, {})
    assert kind == "fail" and "links" in res["msg"]
