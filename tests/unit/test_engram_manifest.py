"""Manifest: schema, identities, parallel verification and every failure it must name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dsv41.engram import synthetic
from dsv41.engram.manifest import SCHEMA_PATH, load_manifest, manifest_from_dict, table_identity, verify
from dsv41.errors import VerificationError

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("golden")
    synthetic.write_synthetic_tables(LAB, d, seed=5, rows_override=[9000, 3000], chunk_size=CHUNK)
    return d


@pytest.fixture
def data(golden: Path, tmp_path: Path) -> Path:
    d = tmp_path / "d"
    shutil.copytree(golden, d)
    return d


def test_schema_file_and_symlink() -> None:
    assert SCHEMA_PATH.exists()
    link = REPO / "schemas" / "manifest.schema.json"
    assert link.is_symlink() and link.resolve() == SCHEMA_PATH


def test_verify_ok_with_and_without_progress(data: Path, capsys) -> None:
    m = load_manifest(data / "manifest.json")
    assert len(m.files[0]["chunks"]) == 3  # 9000*264+664 bytes in 1 MiB chunks
    verify(m, data, workers=2, progress=False)
    verify(data / "manifest.json", None, workers=1, progress=True)
    assert m.table(2).rows == 3000 and m.file(m.tables[1].file)["size"] > 0


def test_flipped_byte_names_file_chunk_range(data: Path) -> None:
    f = data / "model-00047-of-00048.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(CHUNK + 12345)
        b = fh.read(1)
        fh.seek(CHUNK + 12345)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(
        VerificationError, match=rf"model-00047-of-00048.safetensors: chunk 1 bytes \[{CHUNK}, {2 * CHUNK}\): sha256"
    ):
        verify(data / "manifest.json", data, workers=2, progress=False)


def test_two_problems_counted(data: Path) -> None:
    for name in ("model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors"):
        with open(data / name, "r+b") as fh:
            fh.seek(700)
            fh.write(b"\x00\x01\x02")
    with pytest.raises(VerificationError, match=r"and 1 more problem\)"):
        verify(data / "manifest.json", data, progress=False)


def test_truncated(data: Path) -> None:
    f = data / "model-00047-of-00048.safetensors"
    os.truncate(f, CHUNK + 10)
    with pytest.raises(
        VerificationError, match=rf"truncated: {CHUNK + 10} bytes.*chunk 1 bytes \[{CHUNK}, {2 * CHUNK}\)"
    ):
        verify(data / "manifest.json", data, progress=False)


def test_wrong_size_and_missing(data: Path) -> None:
    f = data / "model-00048-of-00048.safetensors"
    with open(f, "ab") as fh:
        fh.write(b"x")
    with pytest.raises(VerificationError, match="model-00048-of-00048.safetensors: wrong size"):
        verify(data / "manifest.json", data, progress=False)
    f.unlink()
    with pytest.raises(VerificationError, match="model-00048-of-00048.safetensors: missing"):
        verify(data / "manifest.json", data, progress=False)


def _doc(data: Path) -> dict:
    return json.loads((data / "manifest.json").read_text())


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda d: d["files"][0].__setitem__("size", "big"), r"schema at files/0/size"),
        (lambda d: d.pop("revision"), r"schema at \(top\): 'revision' is a required"),
        (lambda d: d["files"][0]["chunks"].__setitem__(0, "zz"), r"schema at files/0/chunks/0"),
        (lambda d: d["tables"][0].__setitem__("extra", 1), r"schema at tables/0"),
        (lambda d: d["files"][0]["chunks"].pop(), r"has 2 chunk hashes"),
        (lambda d: d["tables"][0].__setitem__("rows", 10**9), r"beyond"),
        (lambda d: d["tables"][0].__setitem__("file", "other"), r"not in files"),
        (lambda d: d["tables"][1].__setitem__("layer_id", 1), r"two tables"),
        (lambda d: d["tables"][0]["hash"]["multipliers"].__setitem__(0, 3), r"identity .* does not match"),
        (lambda d: d["files"].append(dict(d["files"][0])), r"listed twice"),
        (lambda d: d["tables"][0].__setitem__("weight_bytes", 255), r"row_bytes"),
    ],
)
def test_schema_and_consistency_failures(data: Path, mutate, msg) -> None:
    d = _doc(data)
    mutate(d)
    (data / "bad.json").write_text(json.dumps(d))
    with pytest.raises(VerificationError, match=msg):
        load_manifest(data / "bad.json")


def test_unreadable_manifests(tmp_path: Path) -> None:
    with pytest.raises(VerificationError, match="does not exist"):
        load_manifest(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(VerificationError, match="not valid JSON"):
        load_manifest(tmp_path / "x.json")
    with pytest.raises(VerificationError, match="is a directory"):
        load_manifest(tmp_path)


def test_identity_canonical(data: Path) -> None:
    d = _doc(data)
    t = d["tables"][0]
    assert table_identity(d["layout"], t) == t["identity"]
    # moving the table within a file (other offsets) keeps the identity: it names content
    t2 = dict(t, weight_offset=t["weight_offset"] + 8, scale_offset=t["scale_offset"] + 8)
    assert table_identity(d["layout"], t2) == t["identity"]
    assert table_identity(d["layout"], dict(t, weight_sha256="0" * 64)) != t["identity"]
    # layer_ids of the deployment are not part of a table's identity
    assert table_identity(dict(d["layout"], layer_ids=[1]), t) == t["identity"]
    m = manifest_from_dict(d)
    with pytest.raises(VerificationError, match="needs data_dir"):
        verify(m)


def test_table_geometry_must_match_header(data: Path) -> None:
    d = _doc(data)
    t = d["tables"][0]
    t["weight_offset"] -= 8  # identity does not cover offsets, the chunks still match
    (data / "shifted.json").write_text(json.dumps(d))
    m = load_manifest(data / "shifted.json")
    with pytest.raises(
        VerificationError, match=r"layer 1 table differs from the safetensors header: weight_offset 656 vs header 664"
    ):
        verify(m, data, progress=False)


# ---------------------------------------------------------------- verify cache (issue 10 item 3)


def _flip_keep_mtime(p: Path, offset: int) -> None:
    st = p.stat()
    with open(p, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -d` back to the old mtime


def test_cache_skips_unchanged_and_catches_restored_mtime(data: Path) -> None:
    m = load_manifest(data / "manifest.json")
    cache = data / ".verified.json"
    names = [f["name"] for f in m.files]
    rep = verify(m, data, progress=False, cache=cache)
    assert rep.verified == names and rep.cached == [] and rep.cache_updated
    doc = json.loads(cache.read_text())
    assert doc["format"] == "dsv41-verify-cache/2" and (cache.stat().st_mode & 0o077) == 0
    st = (data / names[0]).stat()
    assert doc["files"][names[0]] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]
    rep = verify(m, data, progress=False, cache=cache)
    assert rep.verified == [] and rep.cached == names and not rep.cache_updated
    _flip_keep_mtime(data / names[0], CHUNK + 5)
    with pytest.raises(VerificationError, match=rf"{names[0]}: chunk 1 bytes \[{CHUNK}, {2 * CHUNK}\): sha256"):
        verify(m, data, progress=False, cache=cache)


def test_full_mode_and_only(data: Path) -> None:
    m = load_manifest(data / "manifest.json")
    cache = data / ".verified.json"
    names = [f["name"] for f in m.files]
    verify(m, data, progress=False, cache=cache)
    rep = verify(m, data, progress=False, cache=cache, mode="full")
    assert rep.verified == names and rep.cached == []
    rep = verify(m, data, progress=False, only=[names[1]], mode="full")
    assert rep.files == [names[1]] and rep.verified == [names[1]]
    with pytest.raises(VerificationError, match="not in the manifest's files"):
        verify(m, data, progress=False, only=["other.safetensors"])
    with pytest.raises(VerificationError, match="verify mode must be one of cached, full"):
        verify(m, data, progress=False, mode="fast")


def test_cache_of_other_manifest_or_garbage_is_ignored(data: Path) -> None:
    m = load_manifest(data / "manifest.json")
    cache = data / ".verified.json"
    verify(m, data, progress=False, cache=cache)
    doc = json.loads(cache.read_text())
    cache.write_text(json.dumps({**doc, "manifest_sha256": "0" * 64}))
    assert len(verify(m, data, progress=False, cache=cache).verified) == 2
    cache.write_text("{not json")
    assert len(verify(m, data, progress=False, cache=cache).verified) == 2


def test_failed_verify_writes_no_cache(data: Path) -> None:
    m = load_manifest(data / "manifest.json")
    cache = data / ".verified.json"
    name = m.files[0]["name"]
    _flip_keep_mtime(data / name, 100)
    with pytest.raises(VerificationError):
        verify(m, data, progress=False, cache=cache)
    assert not cache.exists()


def test_cli_verify_cache_and_full(data: Path, capsys) -> None:
    from dsv41.cli import main

    cache = data / ".verified.json"
    args = ["engram", "verify", "--manifest", str(data / "manifest.json"), "--no-progress", "--cache", str(cache)]
    assert main(args) == 0
    assert len(json.loads(capsys.readouterr().out)["hashed"]) == 2
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["hashed"] == []
    assert main([*args, "--full"]) == 0
    assert len(json.loads(capsys.readouterr().out)["hashed"]) == 2
