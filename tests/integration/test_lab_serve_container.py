"""The engine in a container on the nspawn lab (issue 22; roles/serve's container path, roles/lab
tasks/serve_image.yml): the lab's serving image is built offline from the project's wheelhouse on
one Spark, cached, loaded into both Sparks' dockerd with the same image ID, and that ID is the lab's
serve_image; each rank's systemd unit runs `docker run --init ... IMAGE dsv41 engine serve ...`;
rank 0 answers /health and lists the model; a wrong pin (an image ID the hosts do not have, a repo
digest) refuses on both ranks before anything stops: one line naming the host, the pin and what was
found, the containers, their start times and the units untouched, /health still 200; a unit stop
ends its container within the ExecStop timeout (docker stop -t 30) and --rm leaves nothing.

Takes over the lab on this machine (like test_lab_nspawn); marked lab_long. Prints the image build
(cold), the image load from the cache (warm) and the stop time, for docs/lab.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from labutil import API, LAB, ROOT, needs_lab, play
from nspawnutil import enter, failed_lines, health, needs_hybrid_cgroups, serve_container, serve_unit_state

INV = "inventories/sim"
SPARKS = ("sparkhead", "sparkworker")

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab, needs_hybrid_cgroups]

PLAY = f"""---
- name: The dsv41 package on the Sparks (offline)
  hosts: spark
  gather_facts: false
  roles:
    - role: dsv41
    - role: dsv41_package
- name: Lab weights and target identity
  hosts: spark
  gather_facts: false
  roles:
    - role: dsv41
  tasks:
    - name: Artifacts
      ansible.builtin.include_role:
        name: serve
        tasks_from: artifacts
- name: Tables on the Sparks (the engine's local reader; the controller's generated set, copied)
  hosts: spark
  gather_facts: false
  roles:
    - role: dsv41
  tasks:
    - name: Generate the trusted tables once on the controller
      ansible.builtin.command: >-
        {{{{ ansible_playbook_python | dirname }}}}/dsv41 engram make-tables --config {{{{ dsv41_model_config }}}}
        --out {{{{ dsv41_artifacts_dir }}}}/tables --seed {{{{ dsv41_tables_seed }}}}
      args:
        creates: "{{{{ dsv41_artifacts_dir }}}}/tables/manifest.json"
      delegate_to: localhost
      run_once: true
    - name: Copy them to the Spark
      ansible.builtin.copy:
        src: "{{{{ dsv41_artifacts_dir }}}}/tables/"
        dest: /opt/dsv41/tables/
        mode: "0644"
        directory_mode: "0755"
- name: The serving image
  ansible.builtin.import_playbook: {ROOT}/playbooks/lab_serve_image.yml
- name: Serve in containers
  hosts: spark
  gather_facts: false
  any_errors_fatal: true
  vars:
    engram_overlay_remote: false
    spec_decode_enabled: false
  roles:
    - role: dsv41
    - role: serve
"""
SERVE = PLAY[PLAY.index("- name: Serve in containers") :]


def run(pb: Path, *args: str, timeout: int = 720) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = play(
        str(pb),
        "-i",
        INV,
        "-e",
        "serve_container=true",
        *args,
        env_extra={"ANSIBLE_ROLES_PATH": str(ROOT / "roles")},
        timeout=timeout,
    )
    return res, time.monotonic() - t0


def lab(playbook: str) -> None:
    res = play(playbook, "-i", INV, timeout=1800)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]


def test_ranks_run_in_containers_from_the_lab_image_and_a_wrong_pin_refuses(tmp_path):
    lab("playbooks/lab_down.yml")
    for p in (LAB / "nspawn-cache").glob("serve-image-*"):
        p.unlink()
    lab("playbooks/lab_up.yml")
    try:
        pb = tmp_path / "serve.yml"
        pb.write_text(PLAY)
        first, t_first = run(pb)
        assert first.returncode == 0, first.stdout[-8000:] + first.stderr[-2000:]
        pin = (LAB / "images" / "dsv41-serve.id").read_text().strip()
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", pin), pin
        tar = next((LAB / "nspawn-cache").glob("serve-image-*.tar"))
        print(
            f"\nfirst run (package, tables, image build cold, serve): {t_first:.1f} s; "
            f"image tarball {tar.stat().st_size / 1e6:.0f} MB"
        )
        assert health() == 200
        before = {}
        for h in SPARKS:
            c = serve_container(h)
            assert c["running"] and c["image"] == pin, (h, c)
            unit = enter(h, "systemctl", "cat", "dsv41-serve").stdout
            assert "ExecStart=/usr/bin/docker run --rm --name dsv41-serve --init --pull never --network host" in unit
            assert f"{pin} dsv41 engine serve --config /model/config.json" in unit
            assert "ExecStop=/usr/bin/docker stop -t 30 dsv41-serve" in unit
            assert "--gpus" not in unit
            before[h] = {**c, **serve_unit_state(h)}
        with urllib.request.urlopen(API + "/v1/models", timeout=5) as r:
            assert "dsv41-lab" in r.read().decode()

        # the warm path: the cached tarball loaded into a Spark that lacks the image
        serve_pb = tmp_path / "serve-only.yml"
        serve_pb.write_text("---\n" + PLAY[PLAY.index("- name: The serving image") :])
        tag = enter(
            "sparkworker", "/usr/bin/docker", "images", "--format", "{{.Repository}}:{{.Tag}}", "dsv41-serve"
        ).stdout.split()[0]
        enter("sparkworker", "/usr/bin/docker", "rmi", "-f", tag)  # untagged; the running container keeps the image
        warm, t_warm = run(serve_pb)
        assert warm.returncode == 0, warm.stdout[-6000:]
        assert "changed: [sparkworker]" in warm.stdout.split("load it into each Spark")[1].split("TASK")[0], (
            warm.stdout[-6000:]
        )
        assert (
            enter("sparkworker", "/usr/bin/docker", "image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
            == pin
        )
        print(f"image from the cache (docker load into sparkworker) + serve role, no restart: {t_warm:.1f} s")

        # a wrong pin (an ID the hosts lack; a repo digest): refused on both ranks, nothing stopped
        wrong_id = "sha256:" + "0" * 64
        wrong_digest = "dsv41-serve@sha256:" + "1" * 64
        for wrong in (wrong_id, wrong_digest):
            before = {h: {**serve_container(h), **serve_unit_state(h)} for h in SPARKS}
            res, t_refuse = run(serve_pb, "-e", json.dumps({"serve_image": wrong, "serve_threads": 2}))
            assert res.returncode != 0
            msgs = [m for m in failed_lines(res.stdout) if "is not in dockerd" in m]
            assert msgs, res.stdout[-6000:]
            for h in SPARKS:
                mine = [
                    ln for ln in res.stdout.splitlines() if f"{h}: the serving image {wrong} is not in dockerd" in ln
                ]
                assert mine and "dsv41-serve:" in mine[0] and pin in mine[0], (h, res.stdout[-6000:])  # what was found
            assert "Restart | stop both ranks" not in res.stdout
            for h in SPARKS:
                assert {**serve_container(h), **serve_unit_state(h)} == before[h], h
            assert health() == 200
            print(f"refusal ({wrong[:24]}...): {t_refuse:.1f} s")

        # a unit stop ends the container within docker stop -t 30 (tini forwards SIGTERM)
        t0 = time.monotonic()
        enter("sparkworker", "systemctl", "stop", "dsv41-serve")
        t_stop = time.monotonic() - t0
        left = enter("sparkworker", "/usr/bin/docker", "ps", "-a", "-q", "--filter", "name=dsv41-serve").stdout.strip()
        assert t_stop < 30 and left == "", (t_stop, left)
        print(f"systemctl stop of rank 1 (docker stop -t 30): {t_stop:.1f} s, no container left")
    finally:
        lab("playbooks/lab_down.yml")
