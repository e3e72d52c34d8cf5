"""roles/serve's one container path (issue 22), rendered by ansible-playbook itself through
roles/dsv41_service's systemd template with the variables roles/serve/tasks/service.yml passes:
for both runtimes (the lab engine and vLLM) the unit's ExecStart is `docker run --rm --name UNIT
--init --pull never --network host --ipc host` with the env files, the runtime root, tables and model
read-only, then the pinned image; the runtimes differ only in the image and its arguments; --gpus
only on a host that declares GPUs; ExecStop is `docker stop -t N` inside systemd's stop timeout;
and every rendered unit passes `dsv41 env unit FILE --name dsv41-serve.service` (systemd-analyze
verify, failing on any message) against a root holding the executables it names."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv41.cli import main
from unitutil import SYSTEM_UNITS, stub_root

REPO = Path(__file__).resolve().parents[2]
LAB_ID = "sha256:" + "b" * 64
VLLM_DIGEST = "vllm/vllm-openai@sha256:" + "a" * 64
RUNTIMES = {"lab": LAB_ID, "vllm": VLLM_DIGEST}
VLLM_EXTRA = ["--device", "/dev/infiniband", "--ulimit", "memlock=-1:-1", "--cap-add", "IPC_LOCK"]
PREFIX = "/usr/bin/docker run --rm --name dsv41-serve --init --pull never --network host --ipc host"


def _service_vars() -> dict:
    """The vars: roles/serve/tasks/service.yml passes to dsv41_service (read from the task file)."""
    for task in yaml.safe_load((REPO / "roles/serve/tasks/service.yml").read_text()):
        if (task.get("ansible.builtin.include_role") or {}).get("name") == "dsv41_service":
            return task["vars"]
    raise AssertionError("service.yml: no include_role of dsv41_service")


def render(tmp: Path, name: str, **extra) -> str:
    """The systemd unit of one rank with ``extra`` variables (over a fixed Spark context)."""
    out = tmp / f"{name}.service"
    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "connection": "local",
            "vars_files": [
                str(REPO / f)
                for f in (
                    "roles/dsv41/defaults/main.yml",
                    "roles/serve/defaults/main.yml",
                    "roles/serve/vars/main.yml",
                    "roles/dsv41_service/defaults/main.yml",
                )
            ],
            "tasks": [
                {
                    "name": "Render",
                    "vars": {**_service_vars(), "serve_inputs_sha256": "0" * 64},
                    "ansible.builtin.template": {
                        "src": str(REPO / "roles/dsv41_service/templates/systemd.service.j2"),
                        "dest": str(out),
                        "mode": "0644",
                    },
                }
            ],
        }
    ]
    (tmp / f"{name}.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    fixed = {
        "dsv41_rank": 0,
        "serve_master_address": "198.18.3.1",
        "serve_host": "198.18.0.11",
        "serve_fabric_ifname": "fab0",
        "serve_engram_remote": False,
        "serve_drafter_remote": False,
        "serve_overlay_site": "/opt/dsv41/overlay/site-0123456789abcdef",
        "ansible_python_interpreter": sys.executable,
    }
    bindir = Path(sys.executable).parent
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), PATH=f"{bindir}:{os.environ['PATH']}")
    r = subprocess.run(
        [
            str(bindir / "ansible-playbook"),
            "-i",
            "localhost,",
            str(tmp / f"{name}.yml"),
            "-e",
            json.dumps({**fixed, **extra}),
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return out.read_text()


def _key(text: str, key: str) -> str:
    lines = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]
    assert len(lines) == 1, (key, lines)
    return lines[0]


CASES = {
    f"{rt}-rank{rank}-gpus{g}": {
        "serve_runtime": rt,
        "serve_container": True,
        "serve_image": RUNTIMES[rt],
        "dsv41_rank": rank,
        "dsv41_gpus": g,
    }
    for rt in RUNTIMES
    for rank in (0, 1)
    for g in (0, 1)
}


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("units")
    return {name: render(tmp, name, **v) for name, v in CASES.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_container_unit(units, name) -> None:
    case, text = CASES[name], units[name]
    argv = shlex.split(_key(text, "ExecStart"))
    assert " ".join(argv).startswith(PREFIX), argv[:12]
    assert ("--gpus" in argv) == (case["dsv41_gpus"] > 0) and argv.count("--gpus") <= 1
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    for ro in (
        "/opt/dsv41/runtime:/opt/dsv41/runtime:ro",
        "/opt/dsv41/tables:/opt/dsv41/tables:ro",
        "/opt/dsv41/model:/model:ro",
    ):
        assert ro in mounts, (ro, mounts)
    env_files = [argv[i + 1] for i, a in enumerate(argv) if a == "--env-file"]
    assert env_files == ["/etc/dsv41/engram-overlay.env", "/etc/dsv41/drafter.env", "/etc/dsv41/serve.env"]
    image = argv.index(case["serve_image"])
    assert argv[image + 1] == ("dsv41" if case["serve_runtime"] == "lab" else "vllm")
    if case["serve_runtime"] == "lab":
        assert "--config" in argv and argv[argv.index("--config") + 1] == "/model/config.json"
        # rank 0 keeps its HOLD file outside the container (read-write)
        assert ("/run/dsv41:/run/dsv41" in mounts) == (case["dsv41_rank"] == 0)
    assert _key(text, "ExecStop") == "/usr/bin/docker stop -t 30 dsv41-serve"
    assert _key(text, "ExecStartPre") == "-/usr/bin/docker rm -f dsv41-serve"
    assert _key(text, "TimeoutStopSec") == "60"
    assert "docker.service" in _key(text, "After").split()


def test_the_runtimes_differ_only_in_the_image_and_its_arguments(units) -> None:
    # rank 1 (no HOLD file), vLLM with nothing remote and no fence: the same launch up to the image,
    # but for vLLM's default serve_container_extra_args (RDMA devices, memlock) right before it
    for g in (0, 1):
        lab = shlex.split(_key(units[f"lab-rank1-gpus{g}"], "ExecStart"))
        vllm = shlex.split(_key(units[f"vllm-rank1-gpus{g}"], "ExecStart"))
        prefix = lab[: lab.index(LAB_ID)]
        assert vllm[: len(prefix)] == prefix
        assert vllm[len(prefix) : vllm.index(VLLM_DIGEST)] == VLLM_EXTRA


def test_the_plain_process_stays_for_the_netns_lab(tmp_path) -> None:
    text = render(tmp_path, "plain", serve_runtime="lab", serve_container=False)
    assert _key(text, "ExecStart").startswith(
        "/opt/dsv41/venv/bin/dsv41 engine serve --config /opt/dsv41/model/config.json"
    )
    assert "ExecStop=" not in text and "docker" not in text


@pytest.mark.skipif(
    SYSTEM_UNITS is None or shutil.which("systemd-analyze") is None,
    reason="needs systemd-analyze and the system's units (Debian package systemd)",
)
def test_every_container_unit_passes_dsv41_env_unit(units, tmp_path, capsys) -> None:
    root = stub_root(tmp_path / "root", list(units.values()))
    for name, text in sorted(units.items()):
        f = tmp_path / f"{name}.unit"
        f.write_text(text)
        assert main(["env", "unit", str(f), "--name", "dsv41-serve.service", "--root", str(root)]) == 0, (
            name,
            capsys.readouterr().err,
        )
    # not vacuous: the same unit with a bad value fails in the same root
    bad = tmp_path / "bad.unit"
    bad.write_text(units["lab-rank0-gpus0"].replace("TimeoutStopSec=60", "TimeoutStopSec=sixty"))
    assert main(["env", "unit", str(bad), "--name", "dsv41-serve.service", "--root", str(root)]) == 1
    assert "Failed to parse time value" in capsys.readouterr().err


def test_env_unit_refuses_a_root_that_is_not_a_directory(tmp_path, capsys) -> None:
    f = tmp_path / "u.unit"
    f.write_text("[Service]\nExecStart=/bin/true\n")
    assert main(["env", "unit", str(f), "--name", "x.service", "--root", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--root" in err[0], err


DRAFTER_MOUNT = "/opt/dsv41/drafter:/opt/dsv41/drafter:ro"
#: Drafting on for each runtime (the lab engine drafts in-process; vLLM through the remote drafter),
#: times the rank, times which ranks hold the drafter files (spec_decode_ranks).
DRAFTER_CASES = {
    f"{rt}-rank{rank}-ranks{''.join(map(str, ranks))}": {
        "serve_runtime": rt,
        "serve_container": True,
        "serve_image": RUNTIMES[rt],
        "dsv41_rank": rank,
        "dsv41_gpus": 0,
        "spec_decode_enabled": True,
        "spec_decode_ranks": ranks,
        "dsv41_mgmt_address": "192.0.2.10",
        "serve_drafter_remote": rt == "vllm",
    }
    for rt in RUNTIMES
    for rank in (0, 1)
    for ranks in ([0], [0, 1])
}


@pytest.fixture(scope="module")
def drafter_units(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("drafter-units")
    return {name: render(tmp, name, **v) for name, v in DRAFTER_CASES.items()}


@pytest.mark.parametrize("name", sorted(DRAFTER_CASES))
def test_the_drafter_dir_is_mounted_only_on_the_ranks_that_hold_it(drafter_units, name) -> None:
    # docker creates a missing bind source as an empty directory: mounted on a rank without the
    # drafter files (rank 1 by default) it left /opt/dsv41/drafter empty there, and status failed
    # the deploy with "drafter unreadable" (the nspawn lab's container deploy, 2026-12-03).
    case = DRAFTER_CASES[name]
    argv = shlex.split(_key(drafter_units[name], "ExecStart"))
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert (DRAFTER_MOUNT in mounts) == (case["dsv41_rank"] in case["spec_decode_ranks"]), mounts
