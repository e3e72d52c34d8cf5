"""roles/serve's serving configuration is data on its way into a systemd ExecStart: every
``serve_vllm_args`` and ``serve_container_extra_args`` item comes back from systemd's command-line
parser as exactly that item (spaces, quotes, backslashes, ``%`` specifiers and ``$`` variables
included), and tasks/service.yml's refusal names each value of the wrong shape in one line before
anything is written. The refusal's expression is evaluated by Ansible's templar over the production
inventory's variables (renderutil), and the task itself once by ansible-playbook."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv41.cli import main
from renderutil import REPO, Renderer, systemd_argv, unit_key
from unitutil import SYSTEM_UNITS, stub_root

INVENTORY = REPO / "tests/data/production_inventory"
SERVE_UNIT = "/etc/systemd/system/dsv41-serve.service"
#: Values that break a naive join: whitespace, both quotes, backslash, systemd's specifier and
#: variable syntax, an empty argument, a lone `;` (systemd's command separator).
HOSTILE = ["a b", 'x"y', "it's", "back\\slash", "100%n", "$HOME", "${X}", "", ";", "--opt=va l", "tab\tin"]


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(INVENTORY)


def _refusal_task() -> dict:
    for task in yaml.safe_load((REPO / "roles/serve/tasks/service.yml").read_text()):
        if "ansible.builtin.fail" in task:
            return task
    raise AssertionError("roles/serve/tasks/service.yml: no refusal task")


def problems(renderer: Renderer, extra: dict) -> list[str]:
    """The refusal task's problems for the production inventory with ``extra`` (not trusted as
    templates: data from a file or an ``!unsafe`` value)."""
    task = _refusal_task()
    v = renderer.variant(extra).layers("sparkhead", task["vars"])
    return list(renderer.template(v, "{{ serve_config_problems }}"))


def test_hostile_values_reach_docker_and_vllm_as_the_same_arguments(renderer) -> None:
    tab_free = [h for h in HOSTILE if "\t" not in h]
    r = renderer.variant({"serve_vllm_args": tab_free, "serve_container_extra_args": ["--label", *tab_free]})
    for host in ("sparkhead", "sparkworker"):
        argv = systemd_argv(unit_key(r.render(host).files[SERVE_UNIT], "ExecStart")[0])
        image = r.var(host, "serve_image")
        i = argv.index(image)
        assert argv[i - len(tab_free) - 1 : i] == ["--label", *tab_free], argv[:i]
        assert argv[-len(tab_free) :] == tab_free, argv[-len(tab_free) - 4 :]


@pytest.mark.skipif(
    SYSTEM_UNITS is None or shutil.which("systemd-analyze") is None,
    reason="needs systemd-analyze and the system's units (Debian package systemd)",
)
def test_a_unit_with_hostile_values_passes_systemd_analyze(renderer, tmp_path, capsys) -> None:
    tab_free = [h for h in HOSTILE if "\t" not in h]
    text = renderer.variant({"serve_vllm_args": tab_free}).render("sparkhead").files[SERVE_UNIT]
    root = stub_root(tmp_path / "root", [text])
    f = tmp_path / "dsv41-serve.service"
    f.write_text(text)
    assert main(["env", "unit", str(f), "--name", "dsv41-serve.service", "--root", str(root)]) == 0, (
        capsys.readouterr().err
    )


def test_production_has_nothing_to_refuse(renderer) -> None:
    assert problems(renderer, {}) == []


BAD = {
    "newline": ({"serve_vllm_args": ["--x", "a\nb"]}, "serve_vllm_args item"),
    "tab": ({"serve_container_extra_args": ["tab\tin"]}, "serve_container_extra_args item"),
    "template": ({"serve_vllm_args": ["{{ lookup('pipe', 'id') }}"]}, "template syntax"),
    "statement": ({"serve_container_extra_args": ["{% if 1 %}x{% endif %}"]}, "template syntax"),
    "comment": ({"serve_vllm_args": ["{# c #}"]}, "template syntax"),
    "length": ({"serve_vllm_max_model_len": "327k"}, "serve_vllm_max_model_len"),
    "negative seqs": ({"serve_vllm_max_num_seqs": -4}, "serve_vllm_max_num_seqs"),
    "kv": ({"serve_vllm_kv_cache_gib": "6 GiB"}, "serve_vllm_kv_cache_gib"),
    "fraction": ({"serve_vllm_gpu_memory_utilization": "1.5"}, "serve_vllm_gpu_memory_utilization"),
    "zero fraction": ({"serve_vllm_gpu_memory_utilization": "0.0"}, "serve_vllm_gpu_memory_utilization"),
    "quantization": ({"serve_vllm_quantization": "exl3 --trust-remote-code"}, "serve_vllm_quantization"),
    "drain past docker stop": ({"serve_vllm_shutdown_timeout": 30}, "serve_container_stop_timeout (30"),
    "drain not a number": ({"serve_vllm_shutdown_timeout": "soon"}, "serve_vllm_shutdown_timeout"),
    "queue bound": ({"serve_vllm_max_num_queued_reqs": "8 requests"}, "serve_vllm_max_num_queued_reqs"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_value_of_the_wrong_shape_is_refused_in_one_line_naming_it(renderer, name) -> None:
    extra, needle = BAD[name]
    got = problems(renderer, extra)
    assert len(got) == 1 and needle in got[0] and "\n" not in got[0], got


GOOD = {
    "serve_vllm_gpu_memory_utilization": "0.85",
    "serve_vllm_quantization": "exl3",
    "serve_vllm_shutdown_timeout": "",
    "serve_vllm_kv_cache_gib": "",
    "serve_vllm_max_model_len": 0,
    "serve_vllm_max_num_queued_reqs": 12,
    "serve_vllm_args": ["--enforce-eager"],
}


def test_the_accepted_shapes_render_as_documented(renderer) -> None:
    assert problems(renderer, GOOD) == []
    args = renderer.variant(GOOD).var("sparkhead", "serve_vllm_config_args")
    assert args == [
        "--max-num-seqs",
        "4",
        "--gpu-memory-utilization",
        "0.85",
        "--quantization",
        "exl3",
        "--max-num-queued-reqs",
        "12",
        "--enforce-eager",
    ], args


def test_the_lab_engine_gets_no_vllm_configuration_and_only_the_proxy_capability(renderer) -> None:
    # the stand-in engine spawns the same async proxy, which locks its memory: CAP_IPC_LOCK only
    lab = renderer.variant({"serve_runtime": "lab", "serve_image": "sha256:" + "b" * 64})
    argv = systemd_argv(unit_key(lab.render("sparkhead").files[SERVE_UNIT], "ExecStart")[0])
    assert lab.var("sparkhead", "serve_container_extra_args") == ["--cap-add", "IPC_LOCK"]
    assert not {"--device", "--ulimit", "--max-model-len", "--shutdown-timeout"} & set(argv), argv
    for off in ({"spec_decode_proxy_memlock": False}, {"spec_decode_async": False}, {"spec_decode_enabled": False}):
        quiet = renderer.variant({"serve_runtime": "lab", "serve_image": "sha256:" + "b" * 64, **off})
        assert quiet.var("sparkhead", "serve_container_extra_args") == [], off


def test_ansible_playbook_runs_the_refusal(tmp_path) -> None:
    """The task as ansible-playbook runs it: one failure line naming every bad value."""
    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "connection": "local",
            "vars_files": [
                str(REPO / f)
                for f in ("roles/dsv41/defaults/main.yml", "roles/serve/defaults/main.yml", "roles/serve/vars/main.yml")
            ],
            "tasks": [_refusal_task()],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    bindir = Path(sys.executable).parent
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), PATH=f"{bindir}:{os.environ['PATH']}")
    extra = {
        "serve_vllm_max_num_seqs": "four",
        "serve_vllm_shutdown_timeout": 90,
        "ansible_python_interpreter": sys.executable,
    }
    r = subprocess.run(
        [str(bindir / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "play.yml"), "-e", json.dumps(extra)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    msg = [ln for ln in r.stdout.splitlines() if ln.startswith("[ERROR]") and "serve_vllm_max_num_seqs" in ln]
    assert len(msg) == 1 and "serve_vllm_shutdown_timeout" in msg[0] and "not four" in msg[0], r.stdout[-2000:]
