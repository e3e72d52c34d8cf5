"""`dsv41 drafter ...` and `dsv41 proxy ...`: outputs and one-line errors (exit 1)."""

from __future__ import annotations

import json
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
    assert "hex sha256" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir,
                                         "--target-identity", "xyz"])
    assert "distilled for target" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter",
                                                   ddir, "--target-identity", "ef" * 32])
    assert "CUDA" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir,
                                   "--cuda-graphs"])
    assert "exl3" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir,
                                   "--backend", "exl3"])
    assert "expected cpu, cuda or cuda:N" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0",
                                                            "--drafter", ddir, "--device", "tpu"])
    assert "--ready-file" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", ddir,
                                           "--ready-file", "/nonexistent-dsv41/dir/f"])
    import socket

    with socket.socket() as busy:  # a port in use: one line, nothing left listening
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "cannot listen" in _err(capsys, ["drafter", "serve", "--listen", f"tcp://127.0.0.1:{port}",
                                                "--drafter", ddir])
        assert "cannot listen" in _err(capsys, ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter",
                                                ddir, "--metrics", f"127.0.0.1:{port}"])


def test_train_refuses_missing_inputs(tmp_path, capsys):
    err = _err(capsys, ["drafter", "train", "--config", str(tmp_path / "nope.json"), "--weights",
                        str(tmp_path / "w.safetensors"), "--out", str(tmp_path / "d")])
    assert "nope.json" in err
    err = _err(capsys, ["drafter", "train", "--config", str(tmp_path / "nope.json"), "--weights", "w", "--out", "d",
                        "--manifest", "m.json"])
    assert "go together" in err


def test_proxy_self_test_and_errors_torch_free():
    code = ("import sys; from dsv41.drafter.proxy_cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "self-test", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["torch_loaded"] is False
    r = subprocess.run([sys.executable, "-c", code, "run", "--shm", "dsv41-no-such-ring", "--remote",
                        "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == "dsv41: error: drafter ring: shared memory 'dsv41-no-such-ring' does not exist"
    r = subprocess.run([sys.executable, "-c", code, "run", "--shm", "", "--remote", "tcp://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "dsv41: error: run --shm: empty value; give a value or leave the option out"
    r = subprocess.run([sys.executable, "-c", code, "run", "--shm", "x", "--remote", "http://h:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "tcp://" in r.stderr and "Traceback" not in r.stderr
