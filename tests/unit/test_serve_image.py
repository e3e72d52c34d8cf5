"""dsv41.serve_image / ``dsv41 env image``: the pinned serving image must be in the host's dockerd
with exactly the pinned ID or repo digest (issue 22: otherwise the deploy refuses before stopping
the running engine). Every pin kind the module defines (image ID, repo digest) is found only by an
exact match, never by docker's ID-prefix or tag resolution; every non-pin (empty, tag, short ID,
digest without a repository, upper-case hex) is refused before dockerd is asked; every failure of
the docker CLI (missing, daemon down, timeout, garbage output) is one line. The CLI runs against a
stand-in docker executable that answers like docker 20.10."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest

from dsv41 import serve_image as S
from dsv41.cli import main
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

A, B = "sha256:" + "a" * 64, "sha256:" + "b" * 64
DA = "sha256:" + "d" * 64
LAB = {"Id": A, "RepoTags": ["dsv41-serve:0123456789abcdef"], "RepoDigests": []}
VLLM = {"Id": B, "RepoTags": ["vllm/vllm-openai:v0.33.0"], "RepoDigests": [f"vllm/vllm-openai@{DA}"]}
OTHER = {"Id": "sha256:" + "c" * 64, "RepoTags": ["debian:12"], "RepoDigests": []}


@pytest.mark.parametrize(
    "pin, kind, repo",
    [
        (A, "id", ""),
        (f"vllm/vllm-openai@{DA}", "digest", "vllm/vllm-openai"),
        (f"registry.local:5000/team/vllm@{DA}", "digest", "registry.local:5000/team/vllm"),
    ],
)
def test_pins(pin, kind, repo) -> None:
    p = S.parse_pin(pin)
    assert (p.kind, p.repo, p.value) == (kind, repo, pin)


@pytest.mark.parametrize(
    "pin",
    [
        "",
        "  ",
        "CHANGE_ME",
        "vllm/vllm-openai:latest",
        "dsv41-serve:0123456789abcdef",
        "sha256:" + "a" * 12,
        "a" * 64,
        "@" + DA,
        "sha256:" + "A" * 64,
        f"vllm/vllm-openai@{DA[:-1]}",
        f"vllm/vllm-openai:v1@{DA}x",
    ],
)
def test_non_pins_are_refused(pin) -> None:
    with pytest.raises(ConfigError):
        S.parse_pin(pin)


def test_present_by_id_and_by_digest() -> None:
    assert S.check(A, [OTHER, LAB], "sparkhead") == {"host": "sparkhead", "image": A, "id": A, "ok": True}
    got = S.check(f"vllm/vllm-openai@{DA}", [LAB, VLLM], "sparkworker")
    assert got["id"] == B and got["ok"]


def test_an_id_prefix_or_another_id_is_absent() -> None:
    # docker image inspect sha256:aaaa... would accept a prefix; the check compares the full ID
    other = {**LAB, "Id": A[:-1] + "f"}
    with pytest.raises(VerificationError) as e:
        S.check(A, [other, OTHER], "sparkhead", repository="dsv41-serve")
    msg = str(e.value)
    assert "sparkhead" in msg and A in msg and other["Id"] in msg and "dsv41-serve:0123456789abcdef" in msg
    assert "\n" not in msg and "nothing was stopped" in msg


def test_a_digest_of_the_same_repository_under_another_digest_is_absent() -> None:
    pin = "vllm/vllm-openai@sha256:" + "e" * 64
    with pytest.raises(VerificationError) as e:
        S.check(pin, [VLLM, LAB], "sparkworker")
    msg = str(e.value)
    assert pin in msg and f"vllm/vllm-openai@{DA}" in msg and B in msg and "dsv41-serve" not in msg


def test_the_tag_alone_does_not_count_for_a_digest_pin() -> None:
    tagged_only = {"Id": B, "RepoTags": ["vllm/vllm-openai:v0.33.0"], "RepoDigests": []}
    with pytest.raises(VerificationError) as e:
        S.check(f"vllm/vllm-openai@{DA}", [tagged_only], "sparkhead")
    assert "vllm/vllm-openai:v0.33.0 = " + B in str(e.value)


@pytest.mark.parametrize(
    "images, repository, expect",
    [
        ([], "", "no image with that ID (0 image(s) in all)"),
        ([OTHER], "dsv41-serve", "no image of dsv41-serve (1 image(s) in all)"),
    ],
)
def test_nothing_of_the_repository(images, repository, expect) -> None:
    with pytest.raises(VerificationError) as e:
        S.check(A, images, "sparkhead", repository=repository)
    assert expect in str(e.value)


# --- the CLI against a stand-in docker ------------------------------------------------------


def fake_docker(tmp_path: Path, images: list[dict] | None, mode: str = "ok") -> Path:
    """An executable that answers ``image ls -q --no-trunc`` and ``image inspect ID...`` from
    ``images``; ``mode``: ok, down (the daemon refuses, exit 1), garbage (inspect prints no JSON),
    hang (sleeps past the timeout)."""
    data = tmp_path / "images.json"
    data.write_text(json.dumps(images or []))
    exe = tmp_path / "docker"
    exe.write_text(f"""#!/usr/bin/env python3
import json, sys, time
mode = {mode!r}
images = json.load(open({str(data)!r}))
if mode == "down":
    sys.stderr.write("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?\\n")
    sys.exit(1)
if mode == "hang":
    time.sleep(30)
args = sys.argv[1:]
if args[:2] == ["image", "ls"]:
    print("\\n".join(i["Id"] for i in images))
elif args[:2] == ["image", "inspect"]:
    if mode == "garbage":
        print("not json")
    else:
        print(json.dumps([i for i in images if i["Id"] in args[2:]]))
else:
    sys.exit(2)
""")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def run_cli(capsys, pin: str, docker: Path | str, *extra: str) -> tuple[int, str, str]:
    rc = main(["env", "image", "--pin", pin, "--host", "sparkhead", "--docker", str(docker), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_present(tmp_path, capsys) -> None:
    rc, out, _ = run_cli(capsys, A, fake_docker(tmp_path, [OTHER, LAB]))
    assert rc == 0 and json.loads(out) == {"host": "sparkhead", "id": A, "image": A, "ok": True}


def test_cli_absent_is_one_line_naming_host_pin_and_found(tmp_path, capsys) -> None:
    rc, out, err = run_cli(capsys, B, fake_docker(tmp_path, [LAB]), "--repository", "dsv41-serve")
    lines = err.strip().splitlines()
    assert rc == 1 and out == "" and len(lines) == 1
    assert "sparkhead" in lines[0] and B in lines[0] and f"dsv41-serve:0123456789abcdef = {A}" in lines[0]


@pytest.mark.parametrize(
    "mode, expect",
    [
        ("down", "Cannot connect to the Docker daemon"),
        ("garbage", "not JSON"),
    ],
)
def test_cli_docker_failures_are_one_line(tmp_path, capsys, mode, expect) -> None:
    rc, _, err = run_cli(capsys, A, fake_docker(tmp_path, [LAB], mode))
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and expect in lines[0], lines


def test_cli_docker_missing(tmp_path, capsys) -> None:
    rc, _, err = run_cli(capsys, A, tmp_path / "no-docker")
    assert rc == 1 and "not found" in err and len(err.strip().splitlines()) == 1


def test_cli_docker_timeout(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(S, "TIMEOUT_S", 0.5)
    rc, _, err = run_cli(capsys, A, fake_docker(tmp_path, [LAB], "hang"))
    assert rc == 1 and "did not answer" in err


def test_cli_refuses_a_tag_before_asking_dockerd(tmp_path, capsys) -> None:
    rc, _, err = run_cli(capsys, "vllm/vllm-openai:latest", tmp_path / "no-docker")
    assert rc == 1 and "not pinned" in err and "not found" not in err


def test_cli_no_images(tmp_path, capsys) -> None:
    rc, _, err = run_cli(capsys, A, fake_docker(tmp_path, []))
    assert rc == 1 and "0 image(s) in all" in err


def test_list_images_refuses_a_non_list(tmp_path) -> None:
    exe = tmp_path / "docker"
    exe.write_text('#!/bin/sh\n[ "$2" = ls ] && echo ' + A + " || echo '{\"Id\": 1}'\n")
    exe.chmod(0o755)
    with pytest.raises(Dsv41Error, match="not a list"):
        S.list_images(str(exe))
    assert subprocess.run([str(exe), "image", "ls"], capture_output=True, text=True).stdout.strip() == A
