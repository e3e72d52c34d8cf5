"""What a first real deploy writes, rendered from a filled-in production inventory and checked
against the published system's requirements (docs/seed-requirements.md).

``tests/data/production_inventory`` is ``inventories/production`` with every CHANGE_ME filled in
(documentation addresses only). ``renderutil.Renderer`` renders every unit, env file and template
of every host with Ansible's inventory, variable manager and templar over the roles
playbooks/deploy.yml applies to it; no host is contacted. Each row of the seed-requirements table
marked met names a check: ``render:ID`` is a function of ``CHECKS`` below run on those files, a
``tests/unit/FILE.py::NAME`` is a test that must exist. A row that is not met gives the reason and
the issue that carries it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from renderutil import REPO, Renderer, env_file, systemd_argv, unit_key

INVENTORY = REPO / "tests/data/production_inventory"
SEED = REPO / "docs/seed-requirements.md"
SERVE_UNIT = "/etc/systemd/system/dsv41-serve.service"
DOC_NETS = ("192.0.2.", "198.51.100.", "203.0.113.")
GIB = 1024**3
#: What rollback.yml -e component=NAME sets (playbooks/rollback_component.yml), as extra vars.
ROLLBACKS = {
    "async_handoff": {"spec_decode_async": False},
    "remote_drafter": {"spec_decode_remote": False},
    "remote_engram": {"engram_overlay_remote": False},
}


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(INVENTORY)


@pytest.fixture(scope="module")
def prod(renderer) -> dict:
    """host -> Rendered, for every host of the inventory except the controller."""
    hosts = [h.name for h in renderer.inventory.get_hosts() if h.name != "localhost"]
    return {h: renderer.render(h) for h in hosts}


@pytest.fixture(scope="module")
def rollbacks(renderer) -> dict:
    """component -> {Spark: Rendered} with that component's rollback variables."""
    out = {}
    for name, extra in ROLLBACKS.items():
        r = renderer.variant(extra)
        out[name] = {h: r.render(h) for h in ("sparkhead", "sparkworker")}
    return out


def serve_argv(rendered) -> list[str]:
    """The serving unit's ExecStart as systemd splits it."""
    return systemd_argv(unit_key(rendered.files[SERVE_UNIT], "ExecStart")[0])


def split_run(argv: list[str], image: str) -> tuple[list[str], list[str]]:
    """``docker run`` argv -> (docker's arguments before the image, the command after it)."""
    i = argv.index(image)
    return argv[:i], argv[i + 1 :]


def flag(args: list[str], name: str) -> list[str]:
    """Every value given to ``name`` in ``args``."""
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def sparks(prod) -> list:
    """The two Sparks' renders, rank 0 first."""
    return [prod["sparkhead"], prod["sparkworker"]]


# ---- the inventory -------------------------------------------------------------------------------


def _leaves(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _yaml_files(root: Path) -> dict[str, dict]:
    return {str(p.relative_to(root)): yaml.safe_load(p.read_text()) for p in sorted(root.rglob("*.yml"))}


def test_the_copy_has_every_setting_of_the_production_inventory_and_no_placeholder() -> None:
    prod_inv, copy = _yaml_files(REPO / "inventories/production"), _yaml_files(INVENTORY)
    assert sorted(prod_inv) == sorted(copy)
    for name, doc in prod_inv.items():
        want = {p for p, _ in _leaves(doc)}
        have = dict(_leaves(copy[name]))
        assert want == set(have), (name, want ^ set(have))
        assert not [p for p, v in have.items() if "CHANGE_ME" in str(v)], name
    addresses = [
        v
        for doc in copy.values()
        for p, v in _leaves(doc)
        if re.search(r"(address|ansible_host)$", p) and isinstance(v, str) and re.match(r"\d+\.", v)
    ]
    assert addresses and all(a.startswith(DOC_NETS) for a in addresses), addresses


def test_every_host_gets_its_units_and_env_files(prod) -> None:
    want = {
        "sparkhead": {
            SERVE_UNIT,
            "/etc/dsv41/serve.env",
            "/etc/dsv41/engram-overlay.env",
            "/etc/dsv41/drafter.env",
            "/opt/dsv41/runtime/overlay.json",
        },
        "x86host": {
            "/etc/systemd/system/dsv41-engram-server.service",
            "/etc/dsv41/engram-server.env",
            "/etc/systemd/system/dsv41-drafter.service",
            "/etc/dsv41/drafter-worker.env",
        },
    }
    want["sparkworker"] = want["sparkhead"]
    assert {h: set(r.files) for h, r in prod.items()} == want
    for r in prod.values():
        for path, text in r.files.items():
            assert "{{" not in text and "{%" not in text and "CHANGE_ME" not in text, (r.host, path)
            if path.endswith(".service"):
                for line in unit_key(text, "ExecStart"):
                    assert systemd_argv(line), (r.host, path)


def test_the_serving_line_is_the_container_launch_of_the_pinned_image(prod, renderer) -> None:
    image = renderer.var("sparkhead", "serve_image")
    for r in sparks(prod):
        docker, cmd = split_run(serve_argv(r), image)
        assert docker[:2] == ["/usr/bin/docker", "run"] and cmd[:2] == ["vllm", "serve"], (docker[:2], cmd[:2])


# ---- the rows' checks ----------------------------------------------------------------------------


def _vllm(prod, renderer, host) -> list[str]:
    return split_run(serve_argv(prod[host]), renderer.var(host, "serve_image"))[1]


def _docker(prod, renderer, host) -> list[str]:
    return split_run(serve_argv(prod[host]), renderer.var(host, "serve_image"))[0]


def check_nodes(prod, renderer, rb) -> None:
    fabric = {
        h: next(x for x in renderer.var(h, "dsv41_links") if x["purpose"] == "fabric")
        for h in ("sparkhead", "sparkworker")
    }
    for rank, host in enumerate(("sparkhead", "sparkworker")):
        args = _vllm(prod, renderer, host)
        assert flag(args, "--tensor-parallel-size") == ["2"] and flag(args, "--nnodes") == ["2"], args
        assert flag(args, "--node-rank") == [str(rank)] and ("--headless" in args) == (rank == 1), args
        assert flag(args, "--master-addr") == [fabric["sparkhead"]["address"]], args
        env = env_file(prod[host].files["/etc/dsv41/serve.env"])
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == fabric[host]["name"], env
        assert flag(_docker(prod, renderer, host), "--gpus") == ["all"]


def check_offload_host(prod, renderer, rb) -> None:
    # boilerplate.yml's preflight asserts the RAM the tables need on the offload host
    assert renderer.var("x86host", "preflight_tables_bytes", ("preflight",)) == 202937204736
    units = {p for p in prod["x86host"].files if p.endswith(".service")}
    assert units == {"/etc/systemd/system/dsv41-engram-server.service", "/etc/systemd/system/dsv41-drafter.service"}


def check_links(prod, renderer, rb) -> None:
    for host in ("sparkhead", "sparkworker"):
        offload = [x for x in renderer.var(host, "dsv41_links") if x["purpose"] == "offload"]
        assert len(offload) == 1 and offload[0]["mtu"] == 9000 and offload[0]["peer"] == "x86host", offload
        urls = env_file(prod[host].files["/etc/dsv41/engram-overlay.env"])["DSV41_ENGRAM_REMOTE"].split(",")
        assert f"{offload[0]['peer_address']}:" in urls[renderer.var(host, "dsv41_rank")], urls
        assert urls[renderer.var(host, "dsv41_rank")].endswith("@" + offload[0]["address"]), urls


def _one(args: list[str], name: str) -> str:
    values = flag(args, name)
    assert len(values) == 1, (name, values)
    return values[0]


def check_max_len(prod, renderer, rb) -> None:
    assert {_one(_vllm(prod, renderer, h), "--max-model-len") for h in ("sparkhead", "sparkworker")} == {"327680"}


def check_seqs(prod, renderer, rb) -> None:
    assert {_one(_vllm(prod, renderer, h), "--max-num-seqs") for h in ("sparkhead", "sparkworker")} == {"4"}


def check_kv(prod, renderer, rb) -> None:
    got = {_one(_vllm(prod, renderer, h), "--kv-cache-memory-bytes") for h in ("sparkhead", "sparkworker")}
    assert got == {str(6 * GIB)}, got


def check_draft(prod, renderer, rb) -> None:
    for h in ("sparkhead", "sparkworker"):
        spec = yaml.safe_load(_one(_vllm(prod, renderer, h), "--speculative-config"))
        assert spec["num_speculative_tokens"] == 5, spec
    assert env_file(prod["sparkhead"].files["/etc/dsv41/drafter.env"])["DSV41_DRAFTER_K"] == "5"


def check_ram(prod, renderer, rb) -> None:
    assert renderer.var("x86host", "dsv41_tables_bytes") / GIB == pytest.approx(189, abs=0.05)
    body = (REPO / "roles/preflight/tasks/main.yml").read_text()
    assert "preflight_tables_bytes" in body and "groups['offload']" in body


def check_manifest(prod, renderer, rb) -> None:
    server = env_file(prod["x86host"].files["/etc/dsv41/engram-server.env"])
    assert server["DSV41_TABLES_MANIFEST"] and re.fullmatch(r"[0-9a-f]{64}", server["DSV41_TABLES_MANIFEST_SHA256"])
    tables = renderer.var("sparkhead", "serve_tables_dir")
    for h in ("sparkhead", "sparkworker"):
        assert f"{tables}:{tables}:ro" in flag(_docker(prod, renderer, h), "-v")
        assert re.fullmatch(
            r"[0-9a-f]{64}", yaml.safe_load(prod[h].files["/opt/dsv41/runtime/overlay.json"])["manifest_sha256"]
        )


def check_start_budget(prod, renderer, rb) -> None:
    assert renderer.var("sparkhead", "serve_health_retries") * renderer.var("sparkhead", "serve_health_delay") >= 363


def check_fallback(prod, renderer, rb) -> None:
    tables = renderer.var("sparkhead", "serve_tables_dir")
    for h in ("sparkhead", "sparkworker"):
        assert env_file(prod[h].files["/etc/dsv41/engram-overlay.env"])["DSV41_ENGRAM_REMOTE_REQUIRED"] == "0"
        assert f"{tables}:{tables}:ro" in flag(_docker(prod, renderer, h), "-v")
        args = _vllm(prod, renderer, h)
        assert not [a for a in args if a.startswith(("--quantization", "--cpu-offload", "--load-format"))], args


def check_identities(prod, renderer, rb) -> None:
    argv = systemd_argv(unit_key(prod["x86host"].files["/etc/systemd/system/dsv41-drafter.service"], "ExecStart")[0])
    assert flag(argv, "--target-identity") == [renderer.var("x86host", "dsv41_target_identity")]
    assert re.fullmatch(
        r"[0-9a-f]{64}", env_file(prod["x86host"].files["/etc/dsv41/drafter-worker.env"])["DSV41_DRAFTER_FILES_SHA256"]
    )
    drafter = renderer.var("sparkhead", "serve_drafter_dir")
    assert f"{drafter}:{drafter}:ro" in flag(_docker(prod, renderer, "sparkhead"), "-v")


def check_d_config(prod, renderer, rb) -> None:
    check_kv(prod, renderer, rb)
    for h in ("sparkhead", "sparkworker"):
        assert "DSV41_ENGRAM_REMOTE" in env_file(prod[h].files["/etc/dsv41/engram-overlay.env"])
        mounts = flag(_docker(prod, renderer, h), "-v")
        assert "/opt/dsv41/runtime:/opt/dsv41/runtime:ro" in mounts
        assert [m for m in mounts if m.endswith(":" + renderer.var(h, "serve_overlay_container_site") + ":ro")], mounts
        assert "--speculative-config" in _vllm(prod, renderer, h)
    assert env_file(prod["sparkhead"].files["/etc/dsv41/drafter.env"])["DSV41_DRAFTER_ASYNC"] == "1"


def check_memlock(prod, renderer, rb) -> None:
    for h in ("sparkhead", "sparkworker"):
        docker = _docker(prod, renderer, h)
        assert flag(docker, "--ulimit") == ["memlock=-1:-1"] and flag(docker, "--cap-add") == ["IPC_LOCK"], docker
        assert flag(docker, "--device") == ["/dev/infiniband"], docker
    assert unit_key(prod["x86host"].files["/etc/systemd/system/dsv41-engram-server.service"], "LimitMEMLOCK") == [
        "infinity"
    ]


def check_listen(prod, renderer, rb) -> None:
    argv = systemd_argv(
        unit_key(prod["x86host"].files["/etc/systemd/system/dsv41-engram-server.service"], "ExecStart")[0]
    )
    links = [x["address"] for x in renderer.var("x86host", "dsv41_links") if x["purpose"] == "offload"]
    hosts = [re.sub(r"^\w+://(.*):\d+$", r"\1", u) for u in flag(argv, "--listen")]
    assert hosts == links and len(links) == 2, (hosts, links)


def check_runtime_root(prod, renderer, rb) -> None:
    root = renderer.var("sparkhead", "engram_overlay_root")
    for h in ("sparkhead", "sparkworker"):
        assert f"{root}:{root}:ro" in flag(_docker(prod, renderer, h), "-v")


def check_engram_urls(prod, renderer, rb) -> None:
    by_rank = {
        renderer.var(h, "dsv41_rank"): next(x for x in renderer.var(h, "dsv41_links") if x["purpose"] == "offload")
        for h in ("sparkhead", "sparkworker")
    }
    want = [
        f"{by_rank[r]['peer_address']}:{renderer.var('sparkhead', 'engram_overlay_server_port')}@{by_rank[r]['address']}"
        for r in sorted(by_rank)
    ]
    for h in ("sparkhead", "sparkworker"):
        urls = env_file(prod[h].files["/etc/dsv41/engram-overlay.env"])["DSV41_ENGRAM_REMOTE"].split(",")
        assert [u.split("://", 1)[1] for u in urls] == want, urls


def check_timeout(prod, renderer, rb) -> None:
    for h in ("sparkhead", "sparkworker"):
        assert env_file(prod[h].files["/etc/dsv41/engram-overlay.env"])["DSV41_ENGRAM_REMOTE_TIMEOUT_MS"] == "100"


def check_required(prod, renderer, rb) -> None:
    for h in ("sparkhead", "sparkworker"):
        assert env_file(prod[h].files["/etc/dsv41/engram-overlay.env"])["DSV41_ENGRAM_REMOTE_REQUIRED"] == "0"


def check_image_pinned(prod, renderer, rb) -> None:
    image = renderer.var("sparkhead", "serve_image")
    assert re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", image), image
    for h in ("sparkhead", "sparkworker"):
        docker = _docker(prod, renderer, h)
        assert flag(docker, "--pull") == ["never"], docker


def _drafter_env(r) -> dict:
    return env_file(r.files["/etc/dsv41/drafter.env"])


def check_rb_async(prod, renderer, rb) -> None:
    after = rb["async_handoff"]
    assert all(_drafter_env(r).get("DSV41_DRAFTER_ASYNC") in (None, "0") for r in after.values())
    assert "DSV41_DRAFTER_REMOTE" in _drafter_env(after["sparkhead"])


def check_rb_drafter(prod, renderer, rb) -> None:
    for h, r in rb["remote_drafter"].items():
        env = _drafter_env(r)
        assert not [k for k in env if k.startswith("DSV41_DRAFTER_REMOTE") or k == "DSV41_DRAFTER_ASYNC"], env
        docker, args = split_run(serve_argv(r), renderer.var(h, "serve_image"))
        assert not [m for m in flag(docker, "-v") if m.startswith(renderer.var(h, "serve_drafter_dir") + ":")], docker
        assert "--speculative-config" not in args
        assert _one(args, "--kv-cache-memory-bytes") == str(int(3.75 * GIB)), args


def check_rb_engram(prod, renderer, rb) -> None:
    tables = renderer.var("sparkhead", "serve_tables_dir")
    for h, r in rb["remote_engram"].items():
        assert not [k for k in env_file(r.files["/etc/dsv41/engram-overlay.env"]) if k.startswith("DSV41_ENGRAM")]
        docker, args = split_run(serve_argv(r), renderer.var(h, "serve_image"))
        assert "--compilation-config" not in args and f"{tables}:{tables}:ro" in flag(docker, "-v")


#: render:ID -> its check (prod: host -> Rendered; renderer; rb: the rollbacks' renders).
CHECKS = {
    "REQ-nodes": check_nodes,
    "REQ-offload-host": check_offload_host,
    "REQ-links": check_links,
    "REQ-max-len": check_max_len,
    "REQ-seqs": check_seqs,
    "REQ-kv": check_kv,
    "REQ-draft": check_draft,
    "REQ-ram": check_ram,
    "REQ-manifest": check_manifest,
    "START-budget": check_start_budget,
    "DEP-fallback": check_fallback,
    "DEP-identities": check_identities,
    "DEP-d-config": check_d_config,
    "DEP-memlock": check_memlock,
    "DEP-listen": check_listen,
    "DEP-runtime-root": check_runtime_root,
    "DEP-engram-urls": check_engram_urls,
    "DEP-timeout": check_timeout,
    "DEP-required": check_required,
    "DEP-image-pinned": check_image_pinned,
    "RB-async": check_rb_async,
    "RB-drafter": check_rb_drafter,
    "RB-engram": check_rb_engram,
}


# ---- the table -----------------------------------------------------------------------------------


def seed_rows(text: str) -> list[dict]:
    """The rows of the table under ``## Rows``: dicts keyed by the header's first words (``id``,
    ``requirement``, ``source``, ``rendered``, ``check``, ``status``)."""
    lines = text.splitlines()
    start = lines.index("## Rows")
    table = [ln for ln in lines[start + 1 :] if ln.startswith("|")]
    head = [c.strip().split()[0] for c in table[0].strip().strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip().strip("|").split("|")), strict=False)) for ln in table[2:]]


ROWS = seed_rows(SEED.read_text())


def test_the_table_is_whole() -> None:
    assert len(ROWS) >= 30 and all(len(r) == 6 for r in ROWS), [r for r in ROWS if len(r) != 6]
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)), ids
    named = {r["check"].split(":", 1)[1] for r in ROWS if r["check"].startswith("render:")}
    assert named == set(CHECKS), (
        "checks no row names",
        set(CHECKS) - named,
        "rows naming no check",
        named - set(CHECKS),
    )


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"] != "met"], ids=lambda r: r["id"])
def test_a_row_not_met_says_why_and_which_issue_carries_it(row) -> None:
    assert re.fullmatch(r"not met: .{10,}\(issue (42|44|45|46)\b[^)]*\)", row["status"]), row["status"]
    assert row["check"] == "-", row


def _test_exists(ref: str) -> bool:
    path, name = ref.split("::")
    f = REPO / path
    if not (f.is_file() and path.startswith("tests/")):
        return False
    tree = ast.parse(f.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name and name.startswith("test_") for n in ast.walk(tree))


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"] == "met"], ids=lambda r: r["id"])
def test_a_met_row_passes_its_check(row, prod, renderer, rollbacks) -> None:
    check = row["check"]
    if check.startswith("render:"):
        assert check.split(":", 1)[1] in CHECKS, f"{row['id']}: no check {check}"
        CHECKS[check.split(":", 1)[1]](prod, renderer, rollbacks)
    else:
        assert "::" in check and _test_exists(check), f"{row['id']}: {check} is not a test of this repository"


#: A production missing one requirement -> the checks that must then fail (the checks see it).
BROKEN = {
    "no --max-model-len": ({"serve_vllm_max_model_len": 0}, ["REQ-max-len"]),
    "eight sequences": ({"serve_vllm_max_num_seqs": 8}, ["REQ-seqs"]),
    "the baseline KV budget": ({"serve_vllm_kv_cache_gib": 3.75}, ["REQ-kv", "DEP-d-config"]),
    "no extra docker arguments": ({"serve_container_extra_args": []}, ["DEP-memlock"]),
    "the old health budget": ({"serve_health_retries": 300}, ["START-budget"]),
    "required mode": ({"engram_overlay_required": True}, ["DEP-required", "DEP-fallback"]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_check_fails_on_a_production_without_its_requirement(name, renderer) -> None:
    extra, ids = BROKEN[name]
    broken = renderer.variant(extra)
    rendered = {h: broken.render(h) for h in ("sparkhead", "sparkworker")}
    for i in ids:
        with pytest.raises(AssertionError):
            CHECKS[i](rendered, broken, {})
