"""Bad input to every ``dsv41 engram`` command: one ``dsv41: error:`` line, exit 1, no traceback,
nothing already on disk lost, no half-written output that looks valid (hostile review)."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

from dsv41.cli import main
from dsv41.engram import manifest as mf, reader, shards, synthetic
from dsv41.engram.hashing import NgramHasher
from dsv41.engram.layout import EngramLayout
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
ROWS = [3000, 1000]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def one_error(rc: int, err: str, text: str) -> None:
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsv41: error: "), err
    assert text in lines[0], lines[0]


@pytest.fixture(scope="module")
def tdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    synthetic.write_synthetic_tables(LAB, d, seed=6, rows_override=ROWS, chunk_size=1 << 16)
    return d


def test_huge_integers_are_one_line(capsys, tdir: Path) -> None:
    rc, _, err = run(
        capsys,
        "engram",
        "read-rows",
        "--manifest",
        tdir / "manifest.json",
        "--layer",
        "1",
        "--rows",
        "99999999999999999999",
    )
    one_error(rc, err, "does not fit in a 64-bit integer")
    tm = tdir.parent / "tm.json"
    tm.write_text(json.dumps(list(range(229))))
    rc, _, err = run(
        capsys, "engram", "hash", "--config", LAB, "--token-map", tm, "--tokens", "1,99999999999999999999999"
    )
    one_error(rc, err, "--tokens: 99999999999999999999999 does not fit")


def test_token_map_beyond_compressed_vocab() -> None:
    lay = EngramLayout.from_config(LAB)  # compressed vocab 229
    with pytest.raises(ConfigError, match="outside engram_compressed_vocab_size 229"):
        NgramHasher(lay, np.arange(260, dtype=np.int32))


# --------------------------------------------------------------------------- make-tables


def test_make_tables_bad_seed_writes_nothing(capsys, tmp_path: Path) -> None:
    out = tmp_path / "t"
    rc, _, err = run(capsys, "engram", "make-tables", "--config", LAB, "--out", out, "--seed", "-1")
    one_error(rc, err, "seed must be an int in [0, 2^63)")
    assert not out.exists() or not any(out.iterdir())


def test_make_tables_refuses_foreign_files(capsys, tmp_path: Path) -> None:
    name = shards.shard_names(2)[0]
    (tmp_path / name).write_bytes(b"real checkpoint bytes")
    rc, _, err = run(capsys, "engram", "make-tables", "--config", LAB, "--out", tmp_path)
    one_error(rc, err, "is not a make-tables shard: refusing to replace it")
    assert (tmp_path / name).read_bytes() == b"real checkpoint bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temp files, no manifest
    (tmp_path / name).unlink()
    (tmp_path / "manifest.json").write_text("{not mine")
    rc, _, err = run(capsys, "engram", "make-tables", "--config", LAB, "--out", tmp_path)
    one_error(rc, err, "is not a dsv41 manifest")
    assert (tmp_path / "manifest.json").read_text() == "{not mine"


def test_make_tables_rerun_and_midway_failure_keep_a_valid_set(tmp_path: Path, monkeypatch) -> None:
    stale = tmp_path / f".{shards.shard_names(2)[0]}.tmp99999"  # a killed run's leftover
    stale.write_bytes(b"half a shard")
    p = synthetic.write_synthetic_tables(LAB, tmp_path, seed=1, rows_override=ROWS, chunk_size=1 << 16)
    assert not stale.exists()
    old = p.read_bytes()
    # re-running over its own output is allowed (the lab role does) and reproduces it
    synthetic.write_synthetic_tables(LAB, tmp_path, seed=1, rows_override=ROWS, chunk_size=1 << 16)
    assert p.read_bytes() == old
    real = synthetic.write_table_shard
    calls = []

    def fail_second(path, layer_id, *a, **k):
        calls.append(layer_id)
        if len(calls) == 2:
            real(path, layer_id, *a, **k)
            raise OSError(28, "No space left on device")
        return real(path, layer_id, *a, **k)

    monkeypatch.setattr(synthetic, "write_table_shard", fail_second)
    with pytest.raises(Dsv41Error, match="No space left on device"):
        synthetic.write_synthetic_tables(LAB, tmp_path, seed=2, rows_override=ROWS, chunk_size=1 << 16)
    # the seed-1 set is untouched and still verifies; no temporary files remain
    assert p.read_bytes() == old
    mf.verify(mf.load_manifest(p), tmp_path, progress=False)
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(["manifest.json", *shards.shard_names(2)])
    # into an empty dir: a failing run leaves no manifest at all
    empty = tmp_path / "empty"
    calls.clear()
    with pytest.raises(Dsv41Error):
        synthetic.write_synthetic_tables(LAB, empty, seed=2, rows_override=ROWS, chunk_size=1 << 16)
    assert list(empty.iterdir()) == []


def test_make_tables_needs_free_space(tmp_path: Path, monkeypatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 5))
    with pytest.raises(Dsv41Error, match="only 5 are free"):
        synthetic.write_synthetic_tables(LAB, tmp_path, seed=1, rows_override=ROWS)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- manifest / verify


def test_manifest_command_bad_files_and_out(capsys, tdir: Path, tmp_path: Path) -> None:
    n47 = shards.shard_names(2)[0]
    base = ("engram", "manifest", "--config", LAB, "--data", tdir, "--revision", "r1")
    rc, _, err = run(capsys, *base, "--out", tmp_path / "m.json", "--file", f"1={n47}")
    one_error(rc, err, "missing layer(s) [2]")
    rc, _, err = run(capsys, *base, "--out", tmp_path / "m.json", "--file", f"1=../{n47}", "--file", "2=x")
    one_error(rc, err, "must be a plain file name")
    rc, _, err = run(capsys, *base, "--out", tmp_path / "nodir" / "m.json")
    one_error(rc, err, "cannot write manifest")
    (tmp_path / "adir").mkdir()
    rc, _, err = run(capsys, *base, "--out", tmp_path / "adir")
    one_error(rc, err, "it is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]  # no temp file left behind


def test_verify_directory_dotdot_and_workers(capsys, tdir: Path, tmp_path: Path) -> None:
    d = tmp_path / "v"
    d.mkdir()
    doc = json.loads((tdir / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(doc))
    for f in doc["files"][1:]:
        os.link(tdir / f["name"], d / f["name"])
    (d / doc["files"][0]["name"]).mkdir()
    rc, _, err = run(capsys, "engram", "verify", "--manifest", d / "manifest.json")
    one_error(rc, err, "not a regular file")
    rc, _, err = run(capsys, "engram", "verify", "--manifest", tdir / "manifest.json", "--workers", "0")
    one_error(rc, err, "--workers must be in [1, 1024]")
    doc["files"][0]["name"] = doc["tables"][0]["file"] = ".."
    with pytest.raises(VerificationError, match="fails its schema at .*should not be valid"):
        mf.manifest_from_dict(doc)


def _shard(path: Path, hdr: dict, pad: int = 600) -> Path:
    js = json.dumps(hdr).encode()
    path.write_bytes(struct.pack("<Q", len(js)) + js + b"\0" * pad)
    return path


@pytest.mark.parametrize(
    "woffs,wshape,msg",
    [
        (None, [2, 256], "data_offsets must be"),
        (["a", "b"], [2, 256], "data_offsets must be"),
        ([0], [2, 256], "data_offsets must be"),
        ([600, 88], [2, 256], "data_offsets must be"),
        ([0, 512], [2.0, 256], "must be F8_E4M3 [rows, n]"),
        ([0, 256], [True, 256], "must be F8_E4M3 [rows, n]"),
        ([0, 512], [-2, 256], "must be F8_E4M3 [rows, n]"),
        ([0, 512 * 1000], [2000, 256], "truncated"),
    ],
)
def test_table_regions_malformed_headers(tmp_path: Path, woffs, wshape, msg: str) -> None:
    W, S = shards.weight_name(1), shards.scale_name(1)
    hdr = {
        W: {"dtype": "F8_E4M3", "shape": wshape, "data_offsets": woffs},
        S: {"dtype": "F8_E8M0", "shape": [2, 8], "data_offsets": [512, 528]},
    }
    if msg == "truncated":  # a consistent header whose regions end beyond the file
        hdr[S] = {"dtype": "F8_E8M0", "shape": [2000, 8], "data_offsets": [512000, 528000]}
    with pytest.raises(VerificationError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        shards.table_regions(_shard(tmp_path / "s", hdr), 1)


def test_reader_refuses_fifo_instead_of_hanging(tdir: Path, tmp_path: Path) -> None:
    d = tmp_path / "f"
    d.mkdir()
    m = mf.load_manifest(tdir / "manifest.json")
    os.mkfifo(d / m.table(1).file)
    with reader.LocalRowReader(m, d, threads=1) as r, pytest.raises(Dsv41Error, match="not a regular file"):
        r.read(1, np.array([0]))


# --------------------------------------------------------------------------- serve / sweep


def test_serve_never_deletes_a_foreign_ready_file(capsys, tdir: Path, tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        precious = tmp_path / "precious.txt"
        precious.write_text("keep me")
        rc, _, err = run(
            capsys,
            "engram",
            "serve",
            "--manifest",
            tdir / "manifest.json",
            "--listen",
            f"tcp://127.0.0.1:{port}",
            "--ready-file",
            precious,
        )
        one_error(rc, err, "exists and is not a ready file")
        assert precious.read_text() == "keep me"
        stale = tmp_path / "ready.json"
        stale.write_text(json.dumps({"pid": 1, "listen": ["tcp://127.0.0.1:1"]}))
        rc, _, err = run(
            capsys,
            "engram",
            "serve",
            "--manifest",
            tdir / "manifest.json",
            "--listen",
            f"tcp://127.0.0.1:{port}",
            "--ready-file",
            stale,
        )
        one_error(rc, err, "Address already in use")
        assert not stale.exists()  # a crashed run's ready file must not look like this run's
        rc, _, err = run(
            capsys,
            "engram",
            "serve",
            "--manifest",
            tdir / "manifest.json",
            "--listen",
            "tcp://127.0.0.1:0",
            "--ready-file",
            tmp_path / "nodir" / "r.json",
        )
        one_error(rc, err, "does not exist")
        rc, _, err = run(
            capsys,
            "engram",
            "serve",
            "--manifest",
            tdir / "manifest.json",
            "--listen",
            "tcp://127.0.0.1:0",
            "--metrics",
            "garbage",
        )
        one_error(rc, err, "--metrics must be HOST:PORT")
        rc, _, err = run(
            capsys,
            "engram",
            "serve",
            "--manifest",
            tdir / "manifest.json",
            "--listen",
            "tcp://127.0.0.1:0",
            "--drain-timeout",
            "1e20",
        )
        one_error(rc, err, "--drain-timeout must be in [0, 3600]")
    finally:
        busy.close()


def test_sweep_rank_without_columns_and_bad_seed(capsys, tdir: Path) -> None:
    # tp 16: part 2, ranks 12..15 own no column; the sweep used to loop for ever
    rc, _, err = run(
        capsys,
        "engram",
        "sweep",
        "--manifest",
        tdir / "manifest.json",
        "--remote",
        "tcp://127.0.0.1:1",
        "--tp",
        "16",
        "--rank",
        "15",
        "--lookups",
        "10",
    )
    one_error(rc, err, "owns no Engram columns at tp 16")
    rc, _, err = run(
        capsys,
        "engram",
        "sweep",
        "--manifest",
        tdir / "manifest.json",
        "--remote",
        "tcp://127.0.0.1:1",
        "--rank",
        "0",
        "--seed",
        "-1",
    )
    one_error(rc, err, "--seed must be in [0, 2^63)")


def test_huge_timeouts_are_refused(capsys, tdir: Path) -> None:
    """A 10^14 ms timeout used to overflow socket.settimeout (traceback)."""
    from dsv41.engram.rowsource import parse_remote_env

    rc, _, err = run(
        capsys,
        "engram",
        "sweep",
        "--manifest",
        tdir / "manifest.json",
        "--remote",
        "tcp://127.0.0.1:1",
        "--rank",
        "0",
        "--lookups",
        "10",
        "--timeout-ms",
        "99999999999999",
    )
    one_error(rc, err, "timeout_ms must be in (0, 600000]")
    with pytest.raises(ConfigError, match=r"in \[1, 600000\]"):
        parse_remote_env({"DSV41_ENGRAM_REMOTE": "tcp://h:1", "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "9" * 20}, 1)
