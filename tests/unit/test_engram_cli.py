"""``dsv41 engram ...`` in-process (fast), plus one subprocess run for exit code and one line."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from importlib.machinery import ModuleSpec
from pathlib import Path

import numpy as np
import pytest
import typer

from dsv41.cli import main
from dsv41.engram import cli as ecli, synthetic

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
VEC = Path(__file__).resolve().parents[1] / "data" / "engram_hash_vectors.json"
REAL = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tables_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    synthetic.write_synthetic_tables(LAB, d, seed=4, rows_override=[4000, 1000], chunk_size=1 << 20)
    return d


def test_layout_real_tp2(capsys, tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"text_config": REAL}))
    rc, out, _ = run(capsys, "engram", "layout", str(tmp_path / "c.json"), "--tp", "2")
    assert rc == 0
    j = json.loads(out)
    assert j["layers"][0]["ranks"][0]["rows"] == [0, 192001740]
    assert j["layers"][1]["ranks"][0]["rows"] == [0, 192007016]


@pytest.mark.skipif(not VEC.exists(), reason="shared vectors absent")
@pytest.mark.parametrize("form", ["list", "object"])
def test_hash_matches_vectors(capsys, tmp_path: Path, form: str) -> None:
    v = json.loads(VEC.read_text())
    (tmp_path / "c.json").write_text(json.dumps(REAL))
    tm = v["token_map"] if form == "list" else {"token_map": v["token_map"]}
    (tmp_path / "map.json").write_text(json.dumps(tm))
    case = next(c for c in v["cases"] if c["mask"])
    rc, out, _ = run(
        capsys,
        "engram",
        "hash",
        "--config",
        str(tmp_path / "c.json"),
        "--token-map",
        str(tmp_path / "map.json"),
        "--tokens",
        ",".join(map(str, case["tokens"])),
        "--mask",
        ",".join(map(str, case["mask"])),
    )
    assert rc == 0 and json.loads(out) == {"rows": case["rows"]}


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--tokens", "1,x"], "--tokens: 'x' is not an integer"),
        (["--tokens", ","], "comma-separated list"),
        (["--tokens", "1,2", "--mask", "1"], "--mask has 1 values"),
        (["--tokens", "1,2", "--mask", "1,2"], "0 or 1"),
        (["--tokens", "1,99"], "outside the token map"),
    ],
)
def test_hash_errors(capsys, tmp_path: Path, extra: list[str], msg: str) -> None:
    (tmp_path / "map.json").write_text("[0,1,2,3]")
    rc, out, err = run(
        capsys, "engram", "hash", "--config", str(LAB), "--token-map", str(tmp_path / "map.json"), *extra
    )
    assert rc == 1 and out == "" and err.startswith("dsv41: error: ") and msg in err and err.count("\n") == 1


def test_make_tables_verify_read_rows(capsys, tmp_path: Path) -> None:
    out_dir = tmp_path / "t"
    rc, out, _ = run(capsys, "engram", "make-tables", "--config", str(LAB), "--out", str(out_dir), "--seed", "9")
    assert rc == 0 and Path(out.strip()) == out_dir / "manifest.json"
    rc, out, _ = run(capsys, "engram", "verify", "--manifest", str(out_dir / "manifest.json"), "--no-progress")
    assert rc == 0 and json.loads(out)["verified"] is True
    m = json.loads((out_dir / "manifest.json").read_text())
    rows = m["tables"][1]["rows"]
    rc, out, _ = run(
        capsys,
        "engram",
        "read-rows",
        "--manifest",
        str(out_dir / "manifest.json"),
        "--layer",
        "2",
        "--rows",
        f"0,13,{rows - 1}",
        "--source",
        "local",
    )
    exp = synthetic.synthetic_rows(9, 2, rows, np.asarray([0, 13, rows - 1]))
    assert rc == 0 and out.split() == [bytes(r).hex() for r in exp]
    assert all(len(x) == 528 for x in out.split())


def test_manifest_command_for_existing_shards(capsys, tables_dir: Path, tmp_path: Path) -> None:
    rc, _, _ = run(
        capsys,
        "engram",
        "manifest",
        "--config",
        str(LAB),
        "--data",
        str(tables_dir),
        "--revision",
        "synthetic-seed4",
        "--out",
        str(tmp_path / "m.json"),
        "--chunk-size",
        str(1 << 20),
        "--file",
        "1=model-00047-of-00048.safetensors",
        "--file",
        "2=model-00048-of-00048.safetensors",
    )
    assert rc == 0
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads((tables_dir / "manifest.json").read_text())
    rc, _, err = run(
        capsys,
        "engram",
        "manifest",
        "--config",
        str(LAB),
        "--data",
        str(tables_dir),
        "--revision",
        "r",
        "--out",
        str(tmp_path / "m.json"),
        "--file",
        "x",
    )
    assert rc == 1 and "LAYER=NAME" in err


def test_verify_failure_one_line(capsys, tables_dir: Path, tmp_path: Path) -> None:
    rc, _, err = run(
        capsys, "engram", "verify", "--manifest", str(tables_dir / "manifest.json"), "--data", str(tmp_path)
    )
    assert rc == 1 and "model-00047-of-00048.safetensors: missing" in err and err.count("\n") == 1


def test_read_rows_errors(capsys, tables_dir: Path, monkeypatch) -> None:
    man = str(tables_dir / "manifest.json")
    rc, _, err = run(capsys, "engram", "read-rows", "--manifest", man, "--layer", "1", "--rows", "4000")
    assert rc == 1 and "outside layer 1's table [0, 4000)" in err
    rc, _, err = run(capsys, "engram", "read-rows", "--manifest", man, "--layer", "3", "--rows", "1")
    assert rc == 1 and "no Engram table for layer 3" in err
    rc, _, err = run(
        capsys, "engram", "read-rows", "--manifest", man, "--layer", "1", "--rows", "1", "--source", "udp://a:1"
    )
    assert rc == 1 and "--source: bad transport URL 'udp://a:1': scheme must be one of" in err
    monkeypatch.setitem(sys.modules, "dsv41.engram.client", None)
    rc, _, err = run(
        capsys, "engram", "read-rows", "--manifest", man, "--layer", "1", "--rows", "1", "--source", "tcp://127.0.0.1:9"
    )
    assert rc == 1 and "dsv41.engram.client, which is not installed" in err


def test_read_rows_remote_calls_client(capsys, tables_dir: Path, monkeypatch) -> None:
    calls = {}

    def read_rows_remote(url, manifest, layer_id, rows):
        calls.update(url=url, layer=layer_id, rows=rows.tolist())
        return synthetic.synthetic_rows(4, layer_id, 4000, rows)

    mod = types.ModuleType("dsv41.engram.client")
    mod.read_rows_remote = read_rows_remote
    monkeypatch.setitem(sys.modules, "dsv41.engram.client", mod)
    rc, out, _ = run(
        capsys,
        "engram",
        "read-rows",
        "--manifest",
        str(tables_dir / "manifest.json"),
        "--layer",
        "1",
        "--rows",
        "3,4",
        "--source",
        "tcp://127.0.0.1:9",
    )
    assert rc == 0 and calls == {"url": "tcp://127.0.0.1:9", "layer": 1, "rows": [3, 4]}
    assert out.split()[0] == bytes(synthetic.synthetic_rows(4, 1, 4000, np.asarray([3]))[0]).hex()


def test_remote_cli_hook(monkeypatch) -> None:
    mod = types.ModuleType("dsv41.engram.remote_cli")
    mod.__spec__ = ModuleSpec("dsv41.engram.remote_cli", None)

    def register(app: typer.Typer) -> None:
        app.command("fake-serve")(lambda: None)

    mod.register = register
    monkeypatch.setitem(sys.modules, "dsv41.engram.remote_cli", mod)
    target = typer.Typer()
    assert ecli._register_remote(target) is True
    assert [c.name for c in target.registered_commands] == ["fake-serve"]


def test_bad_config_and_usage(capsys, tmp_path: Path) -> None:
    rc, _, err = run(capsys, "engram", "layout", str(tmp_path / "none.json"))
    assert rc == 1 and "does not exist" in err
    rc, _, err = run(capsys, "engram", "layout", str(LAB), "--tp", "0")
    assert rc == 1 and "tp must be" in err
    rc, _, err = run(capsys, "engram", "make-tables", "--config", str(LAB), "--out", str(tmp_path), "--chunk-size", "5")
    assert rc == 1 and "[4096, 2^40]" in err


def test_subprocess_exit_code_and_one_line(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "dsv41.cli", "engram", "verify", "--manifest", str(tmp_path / "m.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == f"dsv41: error: manifest {tmp_path / 'm.json'} does not exist\n"
