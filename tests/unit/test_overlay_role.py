"""roles/serve under vLLM: the overlay's mount, plugin and flags appear only when something is
remote or rank 0 runs the admission fence (rollback = all off = vLLM's own launch), rendered by
ansible-playbook itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAY = """
- hosts: localhost
  gather_facts: false
  connection: local
  vars_files: ["{repo}/roles/dsv41/defaults/main.yml", "{repo}/roles/serve/defaults/main.yml",
               "{repo}/roles/serve/vars/main.yml"]
  tasks:
    - name: Render
      ansible.builtin.copy:
        content: "{{{{ serve_command }}}}"
        dest: "{out}"
        mode: "0644"
"""


def render(tmp_path: Path, **extra) -> str:
    out = tmp_path / "cmd.txt"
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(repo=REPO, out=out))
    fixed = {
        "serve_runtime": "vllm",
        "serve_image": "vllm/vllm-openai@sha256:" + "a" * 64,
        "dsv41_rank": 0,
        "serve_master_address": "192.0.2.1",
        "serve_host": "192.0.2.10",
        "serve_fabric_ifname": "eth1",
        "serve_overlay_site": "/opt/dsv41/overlay/site-0123456789abcdef",
        "dsv41_mgmt_address": "192.0.2.10",
    }
    args = ["-e", json.dumps({**fixed, **extra})]
    bindir = Path(sys.executable).parent
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), PATH=f"{bindir}:{os.environ['PATH']}")
    subprocess.run(
        [str(bindir / "ansible-playbook"), "-i", "localhost,", str(play), *args],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.read_text()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("role")


def test_nothing_remote_and_no_fence_is_vllms_own_launch(tmp) -> None:
    cmd = render(tmp, serve_engram_remote=False, serve_drafter_remote=False, serve_admission_fence=False)
    assert "vllm serve /model" in cmd
    for absent in (
        "VLLM_PLUGINS",
        "PYTHONPATH",
        "overlay-site",
        "--compilation-config",
        "--speculative-config",
        "--middleware",
        "/run/dsv41",
    ):
        assert absent not in cmd


def test_rank0_runs_the_admission_fence_by_default(tmp) -> None:
    cmd = render(tmp, serve_engram_remote=False, serve_drafter_remote=False)
    assert " --middleware dsv41.overlay.fence.AdmissionFence" in cmd
    assert "-v /opt/dsv41/overlay/site-0123456789abcdef:/opt/dsv41/overlay-site:ro" in cmd
    assert "-e PYTHONPATH=/opt/dsv41/overlay-site" in cmd and "VLLM_PLUGINS" not in cmd  # the fence is no plugin
    assert "-v /run/dsv41:/run/dsv41 " in cmd  # the hold file outlives the container
    assert cmd.index("/run/dsv41:/run/dsv41") < cmd.index("vllm/vllm-openai@") < cmd.index("--middleware")


def test_rank1_has_no_fence(tmp) -> None:
    cmd = render(tmp, serve_engram_remote=False, serve_drafter_remote=False, dsv41_rank=1)
    assert "--headless" in cmd
    for absent in ("--middleware", "/run/dsv41", "overlay-site"):
        assert absent not in cmd


def test_remote_engram_mounts_the_overlay_and_asks_piecewise(tmp) -> None:
    cmd = render(tmp, serve_engram_remote=True, serve_drafter_remote=False)
    assert "-v /opt/dsv41/overlay/site-0123456789abcdef:/opt/dsv41/overlay-site:ro" in cmd
    assert "-e PYTHONPATH=/opt/dsv41/overlay-site -e VLLM_PLUGINS=dsv41_overlay" in cmd
    # the rank's overlay metrics endpoint on its management address (dsv41_overlay_metrics_port)
    assert "-e DSV41_OVERLAY_METRICS_ADDR=192.0.2.10:9471 -e DSV41_OVERLAY_RANK=0 " in cmd
    assert """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'""" in cmd
    assert "--speculative-config" not in cmd and "/opt/dsv41/drafter" not in cmd
    assert cmd.index("overlay-site:ro") < cmd.index("vllm/vllm-openai@") < cmd.index("vllm serve")


def test_remote_drafting_adds_the_dspark_config(tmp) -> None:
    cmd = render(tmp, serve_engram_remote=False, serve_drafter_remote=True, serve_spec_tokens=4)
    assert """--speculative-config '{"method": "dspark", "num_speculative_tokens": 4}'""" in cmd
    assert "-v /opt/dsv41/drafter:/opt/dsv41/drafter:ro" in cmd and "VLLM_PLUGINS=dsv41_overlay" in cmd
    assert "--compilation-config" not in cmd


def test_rank1_with_the_overlay_serves_its_own_metrics(tmp) -> None:
    cmd = render(
        tmp, serve_engram_remote=True, serve_drafter_remote=False, dsv41_rank=1, dsv41_mgmt_address="192.0.2.11"
    )
    assert "-e DSV41_OVERLAY_METRICS_ADDR=192.0.2.11:9471 -e DSV41_OVERLAY_RANK=1 " in cmd and "--headless" in cmd


def test_fence_only_has_no_metrics_endpoint(tmp) -> None:
    cmd = render(tmp, serve_engram_remote=False, serve_drafter_remote=False)
    assert "DSV41_OVERLAY_METRICS_ADDR" not in cmd  # no plugin: nothing to count
