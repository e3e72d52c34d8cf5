"""plugins/modules/engram_manifest.py: real dsv41 verify on small synthetic tables, cache, identities, check mode."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.dsv41.offload.plugins.modules import engram_manifest  # noqa: E402

import dsv41  # noqa: E402

# the lab model config ships inside the package (also found when ansible-test runs a copy of the tests)
LAB = Path(dsv41.__file__).resolve().parent / "data" / "lab_model.json"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    from dsv41.engram import synthetic

    d = tmp_path_factory.mktemp("golden")
    synthetic.write_synthetic_tables(LAB, d, seed=3, rows_override=[600, 300], chunk_size=1 << 16)
    return d


@pytest.fixture
def data(golden, tmp_path):
    import shutil

    d = tmp_path / "tables"
    shutil.copytree(golden, d)
    return d


@pytest.fixture
def count_verify(monkeypatch):
    """Record the files each dsv41 verify() call hashes (the real hashing still runs); calls
    that hash nothing are not recorded."""
    calls = []
    real = engram_manifest.dsv41_manifest._verify_files

    def wrapped(man, d, files, *a, **kw):
        if files:
            calls.append(sorted(f["name"] for f in files))
        return real(man, d, files, *a, **kw)

    monkeypatch.setattr(engram_manifest.dsv41_manifest, "_verify_files", wrapped)
    return calls


def _args(data, **kw):
    return {"manifest": str(data / "manifest.json"), "data_dir": str(data), "cache": str(data / ".verified.json"), **kw}


def test_verify_then_cache_skips_unchanged_shards(data, count_verify, run_module):
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and not res["changed"] and res["cache_updated"]
    assert len(res["files"]) == 2 and res["verified"] == res["files"] and res["cached"] == []
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and res["verified"] == [] and res["cached"] == res["files"] and not res["cache_updated"]
    assert len(count_verify) == 1  # the second run hashed nothing


def test_touched_shard_is_rehashed_alone(data, count_verify, run_module):
    run_module(engram_manifest, _args(data))
    f = data / json.loads((data / "manifest.json").read_text())["files"][1]["name"]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and res["verified"] == [f.name] and count_verify[-1] == [f.name]


def test_corrupt_shard_fails_naming_file_and_chunk(data, run_module):
    run_module(engram_manifest, _args(data))
    name = json.loads((data / "manifest.json").read_text())["files"][0]["name"]
    with open(data / name, "r+b") as fh:  # same size, same inode; mtime changes -> rehashed
        fh.seek(70000)
        b = fh.read(1)
        fh.seek(70000)
        fh.write(bytes([b[0] ^ 1]))
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "fail" and f"{name}: chunk 1 bytes [65536, 131072)" in res["msg"]


def test_check_mode_writes_no_cache(data, run_module):
    kind, res = run_module(engram_manifest, _args(data, _ansible_check_mode=True))
    assert kind == "exit" and not res["cache_updated"] and not (data / ".verified.json").exists()


def test_identity_mismatch_fails(data, run_module):
    kind, res = run_module(engram_manifest, _args(data, identities={"1": "00" * 32}))
    assert kind == "fail" and "layer 1 identity" in res["msg"] and "expected " + "00" * 32 in res["msg"]
    good = {str(t["layer_id"]): t["identity"] for t in res["tables"]}
    kind, res = run_module(engram_manifest, _args(data, identities=good))
    assert kind == "exit"


def test_missing_and_invalid_manifest(data, tmp_path, run_module):
    kind, res = run_module(engram_manifest, _args(data, manifest=str(tmp_path / "none.json")))
    assert kind == "fail" and "none.json does not exist" in res["msg"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "x"}')
    kind, res = run_module(engram_manifest, _args(data, manifest=str(bad)))
    assert kind == "fail" and res["msg"]


def test_stale_cache_of_another_manifest_is_ignored(data, count_verify, run_module):
    (data / ".verified.json").write_text(
        json.dumps({"format": "dsv41-verify-cache/1", "manifest_sha256": "x", "files": {}})
    )
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and len(res["verified"]) == 2


def _flip_byte_keep_mtime(path: Path, offset: int) -> None:
    """Overwrite one byte in place (same size, same inode) and put the old mtime back."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_in_place_write_with_mtime_restored_is_caught(data, run_module):
    """Issue 10 item 3: one byte overwritten in place, mtime set back -> the cached run re-hashes
    (ctime moved) and fails naming the file and chunk."""
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and res["cache_updated"]
    name = json.loads((data / "manifest.json").read_text())["files"][0]["name"]
    _flip_byte_keep_mtime(data / name, 70000)
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "fail" and f"{name}: chunk 1 bytes [65536, 131072)" in res["msg"]


def test_full_mode_rehashes_everything(data, count_verify, run_module):
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and len(count_verify) == 1
    kind, res = run_module(engram_manifest, _args(data, verify="full"))
    assert kind == "exit" and res["verified"] == res["files"] and res["cached"] == [] and res["verify"] == "full"
    assert count_verify[-1] == res["files"]
    kind, res = run_module(engram_manifest, _args(data, verify="sometimes"))
    assert kind == "fail" and "verify" in res["msg"]


def test_old_format_cache_is_rehashed(data, count_verify, run_module):
    """A version-1 cache (size, mtime, inode only) is not trusted: everything is hashed once."""
    from dsv41.engram import manifest as mf

    man = mf.load_manifest(data / "manifest.json")
    keys = {
        f["name"]: [
            (data / f["name"]).stat().st_size,
            (data / f["name"]).stat().st_mtime_ns,
            (data / f["name"]).stat().st_ino,
        ]
        for f in man.files
    }
    (data / ".verified.json").write_text(
        json.dumps({"format": "dsv41-verify-cache/1", "manifest_sha256": mf.manifest_digest(man), "files": keys})
    )
    kind, res = run_module(engram_manifest, _args(data))
    assert kind == "exit" and len(res["verified"]) == 2 and res["cache_updated"]
