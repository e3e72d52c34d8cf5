"""One way to apply a candidate (roles/dsv41/tasks/candidate.yml), and the window's control arm is
production: rendered by ansible-playbook itself, on the same inventory, the files a window switch
re-applies (serve's env file and systemd unit; spec_decode's drafter.env; the table server's env
file and unit) are byte-identical between deploy.yml and playbooks/window_switch.yml with
production's control arm, and a candidate arm differs in exactly the files its variables template.

The variable contexts are built from the playbooks themselves (read from their YAML): deploy.yml's
plays keep their `roles:` (each role's tasks skipped; its defaults load exactly as they do in a
deploy), window_switch.yml's plays keep their `roles:`, their imports (tasks skipped) and their
candidate task (run as written). The files are rendered with the roles' own templates and the
variables their own tasks pass (read from the task files), so nothing here restates a role.
Runs with both inventories: the lab's (the lab engine in its container) and production's (vLLM,
whose launch line reads engram_overlay's and spec_decode's defaults)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsv41.harness import candidates as W
from unitutil import SYSTEM_UNITS, stub_root
from yamltree import items, with_imports

ROLE_VARS = W.ROLE_VARS

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
INVENTORIES = ("sim", "production")
HOSTS = {"spark": ("sparkhead", "sparkworker"), "offload": ("x86host",)}
SWITCH = REPO / "playbooks" / "window_switch.yml"
CANDIDATE_TASK = {"name": "dsv41", "tasks_from": "candidate"}
ARM_TASK = {"name": "dsv41", "tasks_from": "arm"}  # window_switch.yml reads the arm file as data


def _task_vars(path: Path, include: str) -> dict:
    """The ``vars:`` of the task in ``path`` that includes role ``include`` (the variables a role's
    own task passes to the shared service templates)."""
    for task in yaml.safe_load(path.read_text()):
        if (task.get("ansible.builtin.include_role") or {}).get("name") == include:
            return task["vars"]
    raise AssertionError(f"{path}: no include_role of {include}")


def _service_renders(group: str) -> list[dict]:
    """Template tasks rendering the service files that group's configure entry point writes."""
    if group == "spark":
        svc = _task_vars(REPO / "roles/serve/tasks/service.yml", "dsv41_service")
        svc = {**svc, "serve_inputs_sha256": "0" * 64}  # digests of the same files in both contexts
        files = [("roles/spec_decode/templates/drafter.env.j2", "drafter.env", {})]
    else:
        svc = _task_vars(REPO / "roles/engram_server/tasks/configure.yml", "dsv41_service")
        svc = {**svc, "engram_server_manifest_stat": {"stat": {"checksum": "0" * 64}}}
        files = []
    files += [
        (f"roles/dsv41_service/templates/{t}", f"{stem}", svc)
        for t, stem in (("env.j2", "service.env"), ("systemd.service.j2", "service.unit"))
    ]
    return [
        {
            "name": f"Render {dest}",
            "vars": v,
            "ansible.builtin.template": {
                "src": str(REPO / src),
                "mode": "0644",
                "dest": "{{ candidate_apply_out }}/{{ inventory_hostname }}." + dest,
            },
        }
        for src, dest, v in files
    ]


def _skip(entry):
    """A `roles:` entry or import_role task whose defaults load but whose tasks do not run."""
    entry = copy.deepcopy(entry if isinstance(entry, dict) else {"role": entry})
    entry["when"] = False
    return entry


def _production_plays() -> list[dict]:
    """deploy.yml's plays that apply the offload host's and the Sparks' roles, tasks skipped."""
    plays = []
    for play in yaml.safe_load((REPO / "playbooks" / "deploy.yml").read_text()):
        names = [r["role"] if isinstance(r, dict) else r for r in play.get("roles", [])]
        if play.get("hosts") in HOSTS and ({"serve", "engram_server"} & set(names)):
            plays.append(
                {
                    "name": play["name"],
                    "hosts": play["hosts"],
                    "gather_facts": False,
                    "roles": [_skip(r) for r in play["roles"]] + [{"role": "dsv41_service", "when": False}],
                    "tasks": _service_renders(play["hosts"]),
                }
            )
    assert sorted(p["hosts"] for p in plays) == ["offload", "spark"]
    return plays


def _window_bodies(tasks: list[dict]) -> list[dict]:
    """A play's tasks with its import of the window role (the play's body) replaced by that task file."""
    out = []
    for task in tasks:
        imp = task.get("ansible.builtin.import_role") or {}
        if imp.get("name") == "window":
            out += yaml.safe_load((REPO / "roles" / "window" / "tasks" / f"{imp['tasks_from']}.yml").read_text())
        else:
            out.append(task)
    return out


def _switch_plays() -> list[dict]:
    """window_switch.yml's plays: their roles, their imports (tasks skipped) and their candidate
    task as written; everything else (restarts, HOLD, readiness) left out."""
    plays = []
    for play in yaml.safe_load(SWITCH.read_text()):
        tasks = []
        for task in _window_bodies(play["tasks"]):
            if "ansible.builtin.import_role" in task:
                tasks.append(_skip(task))
            elif {k: v for k, v in (task.get("ansible.builtin.include_role") or {}).items()} in (
                CANDIDATE_TASK,
                ARM_TASK,
            ):
                tasks.append(task)
        assert any("ansible.builtin.include_role" in t for t in tasks), f"{play['name']}: no candidate task"
        plays.append(
            {
                "name": play["name"],
                "hosts": play["hosts"],
                "gather_facts": False,
                "roles": play["roles"] + [{"role": "dsv41_service", "when": False}],
                "tasks": tasks + _service_renders(play["hosts"]),
            }
        )
    return plays


def _promote_plays() -> list[dict]:
    """promote.yml's Spark apply play: its roles (tasks skipped), the imports of its apply block
    (tasks skipped) and its candidate task as written (promote_role_vars from the controller)."""
    for play in yaml.safe_load((REPO / "playbooks" / "promote.yml").read_text()):
        block = next(
            (t for t in items(with_imports(play).get("tasks")) if t.get("name") == "Apply the candidate"), None
        )
        if play.get("hosts") == "spark" and block:
            tasks = [
                _skip(t) if "ansible.builtin.import_role" in t else t
                for t in block["block"]
                if "ansible.builtin.import_role" in t or (t.get("ansible.builtin.include_role") or {}) == CANDIDATE_TASK
            ]
            assert [t for t in tasks if "ansible.builtin.include_role" in t], "promote.yml: no candidate task"
            return [
                {
                    "name": "controller",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "The candidate's role variables",
                            "ansible.builtin.set_fact": {"promote_role_vars": "{{ promote_arm }}"},
                        }
                    ],
                },
                {
                    "name": play["name"],
                    "hosts": "spark",
                    "gather_facts": False,
                    "roles": [_skip(r) for r in play["roles"]] + [{"role": "dsv41_service", "when": False}],
                    "tasks": tasks + _service_renders("spark"),
                },
            ]
    raise AssertionError("promote.yml: no Spark apply play")


ARMS = {
    "control": {},  # production's control arm: `dsv41 window plan` gives it no variable
    "slow-rows": W.role_vars(W.load_candidate("slow-rows", REPO / "candidates")),
    "k3": {"spec_decode_k": 3, "spec_decode_timeout_ms": 50},
    # every vLLM serving argument a candidate may set (candidates/vllm-seqs.yml sets one), with
    # the JSON types its schema admits
    "vllm-all": {
        "serve_vllm_max_model_len": 8192,
        "serve_vllm_max_num_seqs": 8,
        "serve_vllm_kv_cache_gib": 2.5,
        "serve_vllm_gpu_memory_utilization": 0.8,
        "serve_vllm_max_num_queued_reqs": 16,
    },
}


def _run(tmp: Path, inventory: str, name: str, plays: list[dict], extra: dict) -> dict[str, str]:
    out = tmp / inventory / name
    out.mkdir(parents=True)
    play = out / "play.yml"
    play.write_text(yaml.safe_dump(plays, sort_keys=False))
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        PATH=f"{BIN}:{os.environ['PATH']}",
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
    )
    r = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(REPO / "inventories" / inventory),
            str(play),
            "-e",
            json.dumps(
                {
                    "ansible_connection": "local",
                    "candidate_apply_out": str(out),
                    "ansible_python_interpreter": sys.executable,
                    **extra,
                }
            ),
        ],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return {p.name: p.read_text() for p in sorted(out.iterdir()) if p.name != "play.yml"}


def _arm_file(path: Path, arm_vars: dict, roles: list[str]) -> str:
    """An arm file as window.yml writes it (window_arm, window_switch_roles); returns its path."""
    path.write_text(json.dumps({"window_arm": arm_vars, "window_switch_roles": roles}))
    return str(path)


@pytest.fixture(scope="module", params=INVENTORIES)
def rendered(request, tmp_path_factory) -> tuple[str, dict[str, dict[str, str]]]:
    """(inventory, {"production" | arm: {"host.file": text}})."""
    tmp = tmp_path_factory.mktemp("candidate")
    inv = request.param
    got = {"production": _run(tmp, inv, "production", _production_plays(), {})}
    for arm, arm_vars in ARMS.items():
        got[arm] = _run(
            tmp,
            inv,
            arm,
            _switch_plays(),
            {
                "window_arm_file": _arm_file(
                    tmp / f"{inv}-{arm}.json", arm_vars, ["engram_server", "serve", "spec_decode"]
                )
            },
        )
    return inv, got


@pytest.fixture(scope="module")
def promoted(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Production's Spark files (deploy.yml) and promote.yml's for no candidate and for slow-rows,
    on the production inventory (vLLM: the launch line reads other roles' defaults)."""
    tmp = tmp_path_factory.mktemp("promote")
    spark = [p for p in _production_plays() if p["hosts"] == "spark"]
    got = {"production": _run(tmp, "production", "production", spark, {})}
    for arm in ("control", "slow-rows"):
        got[arm] = _run(tmp, "production", arm, _promote_plays(), {"promote_arm": ARMS[arm]})
    return got


def test_promote_without_a_delta_renders_production(promoted):
    assert _differing(promoted["production"], promoted["control"]) == []


def test_promote_applies_exactly_the_candidate(promoted):
    assert _differing(promoted["production"], promoted["slow-rows"]) == [
        "sparkhead.service.env",
        "sparkworker.service.env",
    ]


def _differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    assert sorted(a) == sorted(b)
    return sorted(k for k in a if a[k] != b[k])


def test_every_file_is_rendered(rendered):
    _, got = rendered
    hosts = [h for hs in HOSTS.values() for h in hs]
    assert {f.split(".")[0] for f in got["production"]} == set(hosts)
    assert len(got["production"]) == 3 * 2 + 2  # Sparks: drafter.env + env file and unit; x86host: 2
    assert all(text.strip() for text in got["production"].values())


def test_control_arm_is_production_byte_for_byte(rendered):
    _, got = rendered
    assert _differing(got["production"], got["control"]) == []


def test_env_candidate_differs_exactly_in_the_serving_env_files(rendered):
    _, got = rendered
    assert _differing(got["production"], got["slow-rows"]) == ["sparkhead.service.env", "sparkworker.service.env"]
    for host in HOSTS["spark"]:
        text = got["slow-rows"][f"{host}.service.env"]
        assert "DSV41_ENGRAM_FAULT_DELAY_MS=20" in text.replace('"', "")
        # combined over production's: every production line is still there
        assert set(got["production"][f"{host}.service.env"].splitlines()) <= set(text.splitlines())


def test_k_candidate_reaches_drafter_env_and_vllm_speculative_config(rendered):
    inv, got = rendered
    # the lab drafts on rank 0 only; under vLLM every rank holds the drafter settings
    # (spec_decode_ranks) and its launch line carries num_speculative_tokens (serve's
    # serve_spec_tokens reads spec_decode_k)
    expect = (
        ["sparkhead.drafter.env"]
        if inv != "production"
        else sorted([f"{h}.drafter.env" for h in HOSTS["spark"]] + [f"{h}.service.unit" for h in HOSTS["spark"]])
    )
    assert _differing(got["production"], got["k3"]) == expect
    assert "DSV41_DRAFTER_K=3" in got["k3"]["sparkhead.drafter.env"].replace('"', "")


def test_vllm_candidates_change_exactly_the_launch_lines(rendered):
    """Under vLLM (production's inventory) a serving-argument candidate changes both ranks' unit
    (their launch line) and nothing else; under the stand-in engine (the lab's) the plan refuses it
    (window_plan's check_runtime) and nothing renders differently."""
    inv, got = rendered
    expect = [f"{h}.service.unit" for h in HOSTS["spark"]] if inv == "production" else []
    assert _differing(got["production"], got["vllm-all"]) == expect
    if inv == "production":
        for host in HOSTS["spark"]:
            words = got["vllm-all"][f"{host}.service.unit"].split()
            pairs = set(zip(words, words[1:], strict=False))
            for flag in (
                ("--max-model-len", "8192"),
                ("--max-num-seqs", "8"),
                ("--kv-cache-memory-bytes", "2684354560"),
                ("--gpu-memory-utilization", "0.8"),
                ("--max-num-queued-reqs", "16"),
            ):
                assert flag in pairs, (host, flag)


def test_the_settable_variables_are_the_candidate_role_map_and_the_fault_drill():
    settable = yaml.safe_load((REPO / "roles/dsv41/vars/main.yml").read_text())["dsv41_candidate_settable"]
    window = yaml.safe_load((REPO / "playbooks/window.yml").read_text())
    fault = next(p["vars"]["window_arm_start_fault"] for p in window if "window_arm_start_fault" in p.get("vars", {}))
    assert set(settable) == set(ROLE_VARS.values()) | set(fault)


def test_no_set_fact_restates_a_role_default():
    """A set_fact outranks role defaults: one that sets a role-default variable to its default (or
    to itself with a ``default(...)`` fallback, the old arm switch's way) stops it following the
    role the day the default changes. Every playbook and role task file, blocks included; a
    set_fact that changes a default on purpose (a component rollback's setting) is not a restatement."""
    defaults = {}
    for path in sorted((REPO / "roles").glob("*/defaults/main.yml")):
        defaults.update(yaml.safe_load(path.read_text()) or {})
    assert {
        "serve_health_retries",
        "spec_decode_async",
        "spec_decode_k",
        "spec_decode_timeout_ms",
        "engram_overlay_remote",
        "serve_extra_env",
    } <= set(defaults)

    def walk(tasks):
        for t in tasks or []:
            yield t
            for key in ("block", "rescue", "always"):
                yield from walk(t.get(key))

    files = [(p, yaml.safe_load(p.read_text())) for p in sorted((REPO / "playbooks").glob("*.yml"))]
    tasks = [
        (p, t)
        for p, plays in files
        for play in plays or []
        for t in walk((play.get("pre_tasks") or []) + (play.get("tasks") or []) + (play.get("post_tasks") or []))
    ]
    tasks += [
        (p, t) for p in sorted((REPO / "roles").glob("*/tasks/*.yml")) for t in walk(yaml.safe_load(p.read_text()))
    ]
    assert len(tasks) > 200
    found = []
    for path, t in tasks:
        for k, v in (t.get("ansible.builtin.set_fact") or {}).items():
            if k in defaults and (v == defaults[k] or (isinstance(v, str) and f"{k} | default(" in v)):
                found.append(f"{path.relative_to(REPO)}: {k}: {v!r}")
    # a component rollback's settings (remote_drafter: no capacity mode, also where the inventory
    # turned it on) come from dsv41.harness.components.ROLE_VARS through one dynamic set_fact
    assert found == []
    # and the window switch uses | default() on no role default either
    text = SWITCH.read_text()
    assert [k for k in defaults if f"{k} | default(" in text] == []


def test_a_name_outside_the_settable_ones_is_refused(tmp_path):
    plays = [p for p in _switch_plays() if p["hosts"] == "offload"]
    with pytest.raises(AssertionError) as err:
        _run(
            tmp_path,
            "sim",
            "bad",
            plays,
            {"window_arm_file": _arm_file(tmp_path / "bad.json", {"serve_health_delay": 0}, [])},
        )
    assert "serve_health_delay" in str(err.value) and "not settable by a candidate" in str(err.value)


@pytest.mark.skipif(
    SYSTEM_UNITS is None or not __import__("shutil").which("systemd-analyze"),
    reason="needs systemd-analyze and the system's units (Debian package systemd)",
)
def test_every_rendered_unit_passes_systemd_analyze_verify(rendered, tmp_path):
    """Every systemd unit the roles render (both inventories, production and every window arm)
    passes ``systemd-analyze verify`` with no message at all, as the role's validate requires; a
    unit with one unknown key or one bad value in the same root fails (the check is not vacuous)."""
    from dsv41.entrypoints.unit_check import verify_unit

    inv, got = rendered
    units = {
        f"{arm}/{name}": text
        for arm, files in got.items()
        for name, text in files.items()
        if name.endswith(".service.unit")
    }
    assert len(units) == 3 * len(got)
    root = stub_root(tmp_path / "root", list(units.values()))
    for key, text in sorted(units.items()):
        assert verify_unit(text, "dsv41-" + key.split("/")[1].split(".")[0] + ".service", root) == [], (inv, key)
    good = units["production/x86host.service.unit"]
    for bad, expect in (("BogusKey=1", "Unknown key"), ("Restart=sometimes", "restart specifier")):
        broken = good.replace("[Service]\n", f"[Service]\n{bad}\n", 1)
        assert any(expect in m for m in verify_unit(broken, "dsv41-broken.service", root)), bad
