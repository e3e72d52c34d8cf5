"""`dsv41 drafter ...` and `dsv41 proxy ...`: outputs and one-line errors (exit 1)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys

import pytest

from dsv41.cli import main
from dsv41.drafter.model import random_drafter

TARGET = "cd" * 32


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    random_drafter(d, vocab_size=40, hidden_size=16, d_model=32, target_identity=TARGET)
    return str(d)


@pytest.fixture(autouse=True)
def root_logging():
    """The root logger as the test found it, and one handler on it for the test's length.

    ``dsv41 drafter serve`` calls ``logging.basicConfig(level=INFO)``, which acts only when the
    root logger has no handler: then it binds a StreamHandler to the ``sys.stderr`` of that
    moment (here capsys's buffer) and lowers the root level to INFO for the rest of the process.
    Whether it acts depended on what ran before (pytest's logging plugin keeps handlers on the
    root; ``-p no:logging``, or a handler list left empty, does not), and once it had acted the
    worker's INFO "listening" line came first on stderr. So each test starts with a handler on
    the root (basicConfig never acts in-process) and ends with the root restored. The real
    process's stderr, where basicConfig does act: test_serve_metrics_busy_stderr_of_the_process."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    keep = logging.NullHandler()
    root.addHandler(keep)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("dsv41: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_identity_command(ddir, capsys):
    assert main(["drafter", "identity", ddir]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids["target"] == TARGET and len(ids["drafter"]) == len(ids["markov"]) == 64
    assert "not found" in _err(capsys, ["drafter", "identity", ddir + "-missing"])


def test_serve_refuses_bad_arguments(ddir, capsys):
    assert "expected tcp://HOST:PORT" in _err(capsys, ["drafter", "serve", "--listen", "tcp://x", "--drafter", ddir])
    assert "hex sha256" in _err(
        capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir, "--target-identity", "xyz"]
    )
    assert "distilled for target" in _err(
        capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir, "--target-identity", "ef" * 32]
    )
    assert "CUDA" in _err(
        capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir, "--cuda-graphs"]
    )
    assert "exl3" in _err(
        capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir, "--backend", "exl3"]
    )
    assert "expected cpu, cuda or cuda:N" in _err(
        capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir, "--device", "tpu"]
    )
    assert "--ready-file" in _err(
        capsys,
        [
            "drafter",
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--drafter",
            ddir,
            "--ready-file",
            "/nonexistent-dsv41/dir/f",
        ],
    )
    with socket.socket() as busy:  # a port in use: one line, nothing left listening
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "cannot listen" in _err(
            capsys, ["drafter", "serve", "--listen", f"tcp://127.0.0.1:{port}", "--drafter", ddir]
        )
        assert "cannot listen" in _err(
            capsys,
            ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir, "--metrics", f"127.0.0.1:{port}"],
        )


def test_serve_metrics_busy_stderr_of_the_process(ddir):
    """`dsv41 drafter serve --metrics BUSY` as a real process: one line on stderr, exit 1."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "dsv41.cli",
                "drafter",
                "serve",
                "--listen",
                "tcp://127.0.0.1:0",
                "--drafter",
                ddir,
                "--metrics",
                f"127.0.0.1:{busy.getsockname()[1]}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1
    assert r.stderr.strip().startswith("dsv41: error: --metrics") and "\n" not in r.stderr.strip(), r.stderr


def test_train_refuses_missing_inputs(tmp_path, capsys):
    err = _err(
        capsys,
        [
            "drafter",
            "train",
            "--config",
            str(tmp_path / "nope.json"),
            "--weights",
            str(tmp_path / "w.safetensors"),
            "--out",
            str(tmp_path / "d"),
        ],
    )
    assert "nope.json" in err
    err = _err(
        capsys,
        [
            "drafter",
            "train",
            "--config",
            str(tmp_path / "nope.json"),
            "--weights",
            "w",
            "--out",
            "d",
            "--manifest",
            "m.json",
        ],
    )
    assert "go together" in err


def test_proxy_self_test_and_errors_torch_free():
    code = (
        "import sys; from dsv41.drafter.proxy_cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code, "self-test", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["torch_loaded"] is False
    r = subprocess.run(
        [sys.executable, "-c", code, "run", "--shm", "dsv41-no-such-ring", "--remote", "tcp://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 1
        and r.stderr.strip() == "dsv41: error: drafter ring: shared memory 'dsv41-no-such-ring' does not exist"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "run", "--shm", "", "--remote", "tcp://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip() == "dsv41: error: run --shm: empty value; give a value or leave the option out"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "run", "--shm", "x", "--remote", "http://h:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "tcp://" in r.stderr and "Traceback" not in r.stderr
