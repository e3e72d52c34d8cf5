"""The production inventory differs from the nspawn lab inventory only in addresses, users, paths,
hardware facts, the real artefacts and the lab's own machinery.

The class: a variable set in one inventory and not the other is a code path the lab never runs
(or one production never runs). Both inventories are read through Ansible itself
(``ansible-inventory --list`` and ``--host localhost``: group_vars, host_vars and hosts.yml merged
as a play sees them, values left untemplated), and every key that only one of them sets must be in
the allowlist below, with its category and why. A new key in either inventory fails here until it
is set in both or listed; a listed key that no longer differs fails too (the list stays current).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = {"production": ROOT / "inventories" / "production", "lab": ROOT / "inventories" / "sim"}
ANSIBLE_INVENTORY = Path(sys.executable).parent / "ansible-inventory"

# What may differ, by category:
#   address   - where a host is reached (management and link addresses, interface names)
#   user      - who the controller logs in as, and how (ssh key, known_hosts, become)
#   path      - where files live on the controller or the hosts
#   hardware  - what the GB10 / x86 hardware has that the lab's machines do not (GPU, RDMA, RAM)
#   artefact  - the real checkpoint, image, manifest and drafter, which the lab generates instead
#   lab       - the lab's own machinery and its short-run settings (no production counterpart)
CATEGORIES = {"address", "user", "path", "hardware", "artefact", "lab"}

# key -> (category, why); set in production only.
PRODUCTION_ONLY = {
    "drafter_worker_device": (
        "hardware",
        "the drafter runs on the x86 host's GPU (cuda:0); the lab has no GPU: the role default cpu",
    ),
    "dsv41_package_wheelhouse_drop_pins": (
        "hardware",
        "the hosts' torch is the CUDA/aarch64 build that comes with them; the lab installs the pinned torch+cpu wheel",
    ),
    "dsv41_tables_bytes": (
        "hardware",
        "resident bytes of the real Engram shards (~189 GiB) for the RAM check; "
        "the lab's generated tables are measured where they are made",
    ),
    "dsv41_target_identity": (
        "artefact",
        "sha256 identity of the real served target; the lab derives it from the weights it generates",
    ),
    "dsv41_trusted_manifest": (
        "artefact",
        "the real shards' trusted manifest; the lab generates tables from dsv41_tables_seed and writes their manifest",
    ),
    "serve_model_dir": (
        "path",
        "where the real checkpoint lies on each Spark; the lab's weights are an artefact under dsv41_artifacts_dir",
    ),
    "serve_model_name": (
        "artefact",
        "the model id clients ask for (deepseek-v4.1-flash); the lab serves its "
        "generated model under the role default dsv41-lab",
    ),
    "serve_threads": (
        "hardware",
        "OMP/torch CPU threads per rank on the GB10, pinned explicitly; the lab takes the role default, the same 1",
    ),
}

# key -> (category, why[, only these hosts]); set in the lab only.
LAB_ONLY = {
    "serve_container": (
        "lab",
        "off on the nspawn lab until the container path has passed there with the whole "
        "stack (issue 22); production takes the role default (on for vLLM)",
    ),
    "serve_image_repository": (
        "artefact",
        "the lab's locally built serving image's repository, named in the "
        "pin check's refusal; production's pin is a repo digest that names it",
    ),
    "dsv41_package_extras": (
        "lab",
        "torch on the Sparks: the lab engine runs as a plain process there; "
        "production's Sparks use the serving image's",
    ),
    "ansible_host": (
        "address",
        "the lab sets it once in group_vars (each machine's dsv41_mgmt_address), so the "
        "implicit localhost inherits it (unused there: ansible_connection local); "
        "production gives it per host in hosts.yml",
        {"localhost"},
    ),
    "ansible_connection": (
        "user",
        "ssh into each nspawn machine by its management address; production uses ansible.cfg's ssh default",
    ),
    "ansible_become_method": ("user", "sudo, spelled out for the lab's ops user; production's default is sudo too"),
    "ansible_host_key_checking": ("user", "the lab's generated host keys are checked against its own known_hosts"),
    "ansible_ssh_common_args": ("user", "the lab's known_hosts file and ssh options"),
    "ansible_ssh_pipelining": ("user", "set per lab host; production takes ansible.cfg's pipelining = true"),
    "ansible_ssh_private_key_file": ("user", "the key the lab generates for its ops user"),
    "dsv41_lab_blackhole": ("lab", "the 198.18.0.0/15 blackhole route the lab installs first"),
    "dsv41_lab_dir": ("lab", "the lab's state directory on the controller"),
    "dsv41_lab_mgmt_bridge": ("lab", "the bridge that stands in for the management network"),
    "dsv41_lab_mgmt_gateway": ("lab", "the bridge's address on the controller"),
    "dsv41_lab_ssh_user": ("user", "the ops user the lab creates in each machine"),
    "dsv41_lab_weights": ("lab", "the generated lab model's weights (production: serve_model_dir)"),
    "dsv41_lab_weights_key": ("lab", "the digest that names the generated weights"),
    "dsv41_model_config": ("lab", "the small lab model's config (production serves the real checkpoint)"),
    "dsv41_artifacts_dir": ("path", "where the lab keeps what it generates (weights, drafter)"),
    "dsv41_drafter_train_steps": ("lab", "the lab trains a tiny drafter (production: dsv41_drafter_src given)"),
    "dsv41_tables_seed": (
        "lab",
        "the lab generates the Engram tables from this seed (production: the trusted manifest's shards)",
    ),
    "dsv41_package_manage_packages": (
        "lab",
        "the nspawn rootfs is built with its OS packages and has no registry; production installs them with apt",
    ),
    "qualify_transport_backend": ("hardware", "TCP over veth in the lab; production qualifies the RDMA backend"),
    "qualify_latency_p50_max_us": ("hardware", "veth on a 2-core machine, not the RDMA link's budget"),
    "qualify_latency_p99_max_us": ("hardware", "veth on a 2-core machine, not the RDMA link's budget"),
    "qualify_bandwidth_gbps_min": ("hardware", "veth bandwidth, not the 200 Gb/s link's"),
    "qualify_bandwidth_both_gbps_min": ("hardware", "veth bandwidth, not the 200 Gb/s link's"),
    "qualify_sweep_lookups": ("lab", "a shorter sweep to fit a lab run"),
    "qualify_counter_interval_s": ("lab", "a shorter counter interval to fit a lab run"),
    "monitoring_scrape_interval": ("lab", "5 s scrapes so alerts fire within a lab run"),
    "monitoring_evaluation_interval": ("lab", "5 s rule evaluation so alerts fire within a lab run"),
    "monitoring_alert_overrides": ("lab", "shorter alert windows so every alert can fire within a lab run"),
    "monitoring_config_dir": (
        "path",
        "Prometheus' files under /opt/dsv41/monitoring in the machine, not Debian's /etc/prometheus",
    ),
    "monitoring_storage_dir": ("path", "Prometheus' TSDB under /opt/dsv41/monitoring/data"),
    "monitoring_node_exporter": (
        "lab",
        "one node exporter, on x86host (the three machines share the controller's "
        "kernel and RAM); production's default (not dsv41_lab) runs it on every host",
        {"x86host"},
    ),
}


def _inventory(path: Path) -> dict[str, dict]:
    """``{"groups": {group: {"hosts", "children"}}, "hostvars": {host: vars}}`` as Ansible reads ``path``
    (implicit localhost included, with its host_vars)."""

    def run(*args: str) -> dict:
        r = subprocess.run(
            [str(ANSIBLE_INVENTORY), "-i", str(path), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    doc = run("--list")
    hostvars = dict(doc.pop("_meta")["hostvars"])
    hostvars["localhost"] = run("--host", "localhost")
    return {"groups": doc, "hostvars": hostvars}


@pytest.fixture(scope="module")
def inventories() -> dict[str, dict]:
    return {name: _inventory(path) for name, path in INVENTORIES.items()}


def test_the_same_hosts_groups_and_files(inventories) -> None:
    prod, lab = inventories["production"], inventories["lab"]
    assert prod["groups"] == lab["groups"]
    assert set(prod["hostvars"]) == set(lab["hostvars"]) == {"sparkhead", "sparkworker", "x86host", "localhost"}

    def files(p):
        return sorted(str(f.relative_to(p)) for f in p.rglob("*") if f.is_file())

    assert files(INVENTORIES["production"]) == files(INVENTORIES["lab"])


def test_the_allowlist_is_well_formed() -> None:
    assert not set(PRODUCTION_ONLY) & set(LAB_ONLY)
    for key, entry in {**PRODUCTION_ONLY, **LAB_ONLY}.items():
        assert entry[0] in CATEGORIES and len(entry[1]) > 20, key


def _only(entry, host: str) -> bool:
    return len(entry) < 3 or host in entry[2]


def test_keys_differ_only_as_the_allowlist_says(inventories) -> None:
    prod, lab = inventories["production"]["hostvars"], inventories["lab"]["hostvars"]
    unexpected, seen = [], set()
    for host in sorted(prod):
        p, l_ = set(prod[host]), set(lab[host])
        for key in sorted(p - l_):
            seen.add(key)
            if key not in PRODUCTION_ONLY or not _only(PRODUCTION_ONLY[key], host):
                unexpected.append(f"{host}: {key} is set in production only")
        for key in sorted(l_ - p):
            seen.add(key)
            if key not in LAB_ONLY or not _only(LAB_ONLY[key], host):
                unexpected.append(f"{host}: {key} is set in the lab only")
    assert not unexpected, "set it in both inventories, or list it with its category and why:\n" + "\n".join(unexpected)
    stale = sorted((set(PRODUCTION_ONLY) | set(LAB_ONLY)) - seen)
    assert not stale, f"listed as differing but set in both (or neither): {stale}"


def test_the_links_have_the_same_shape(inventories) -> None:
    """Per host: as many links, the same keys, purposes, prefixes, MTUs and peers; only names and
    addresses (category address) differ."""
    prod, lab = inventories["production"]["hostvars"], inventories["lab"]["hostvars"]
    for host in ("sparkhead", "sparkworker", "x86host"):

        def shape(links):
            return [(sorted(x), x["purpose"], x["prefix"], x["mtu"], x["peer"]) for x in links]

        assert shape(prod[host]["dsv41_links"]) == shape(lab[host]["dsv41_links"]), host
