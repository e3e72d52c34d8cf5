"""Synthetic table writer: real safetensors layout, determinism, byte-level properties."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dsv41.engram import shards, synthetic
from dsv41.engram.layout import EngramLayout
from dsv41.engram.manifest import build_manifest, load_manifest
from dsv41.errors import Dsv41Error, VerificationError

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
torch = pytest.importorskip("torch")
safe_open = pytest.importorskip("safetensors").safe_open


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tables")
    # 70000 rows crosses a synthetic block boundary (65536)
    synthetic.write_synthetic_tables(LAB, d, seed=7, rows_override=[70000, 3000], chunk_size=1 << 20)
    return d


def test_layout_of_files(small: Path) -> None:
    m = load_manifest(small / "manifest.json")
    assert [f["name"] for f in m.files] == ["model-00047-of-00048.safetensors", "model-00048-of-00048.safetensors"]
    t1, t2 = m.tables
    assert (t1.weight_offset, t2.weight_offset) == (664, 672)
    assert t1.scale_offset == 664 + 70000 * 256 and t1.row_bytes == 264
    raw = (small / t1.file).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8 : 8 + n])
    assert hdr["layers.1.engram.embed.weight"] == {
        "dtype": "F8_E4M3",
        "shape": [70000, 256],
        "data_offsets": [0, 70000 * 256],
    }
    assert hdr["layers.1.engram.embed.scale"]["dtype"] == "F8_E8M0"
    assert len(raw) == 8 + n + 70000 * 264
    assert shards.table_regions(small / t1.file, 1) == {
        "rows": 70000,
        "weight_offset": 664,
        "scale_offset": t1.scale_offset,
        "weight_bytes": 256,
        "scale_bytes": 8,
    }


def test_safetensors_oracle_and_synthetic_rows(small: Path) -> None:
    m = load_manifest(small / "manifest.json")
    for t in m.tables:
        with safe_open(str(small / t.file), framework="pt") as f:
            w = f.get_slice(t.weight_name)
            s = f.get_slice(t.scale_name)
            assert w.get_dtype() == "F8_E4M3" and s.get_dtype() == "F8_E8M0"
            wt = f.get_tensor(t.weight_name).view(torch.uint8).numpy()
            st = f.get_tensor(t.scale_name).view(torch.uint8).numpy()
        assert wt.shape == (t.rows, 256) and st.shape == (t.rows, 8)
        assert not ((wt & 0x7F) == 0x7F).any()  # no E4M3FN NaN encodings
        assert (st == 0).any() and (st == 255).any()
        ids = np.asarray([0, 1, 2, t.rows - 1, t.rows // 2, min(65536, t.rows - 1)])
        exp = synthetic.synthetic_rows(7, t.layer_id, t.rows, ids)
        np.testing.assert_array_equal(exp[:, :256], wt[ids])
        np.testing.assert_array_equal(exp[:, 256:], st[ids])


def test_deterministic(tmp_path: Path, small: Path) -> None:
    a = synthetic.write_synthetic_tables(LAB, tmp_path / "a", seed=7, rows_override=[70000, 3000], chunk_size=1 << 20)
    b = synthetic.write_synthetic_tables(LAB, tmp_path / "b", seed=8, rows_override=[70000, 3000], chunk_size=1 << 20)
    ma, mb, m0 = load_manifest(a), load_manifest(b), load_manifest(small / "manifest.json")
    assert ma.to_dict()["tables"] == m0.to_dict()["tables"] and ma.files == m0.files
    assert ma.tables[0].identity != mb.tables[0].identity
    assert ma.revision == "synthetic-seed7"


def test_full_lab_tables_and_build_manifest(tmp_path: Path) -> None:
    p = synthetic.write_synthetic_tables(LAB, tmp_path, seed=1)
    m = load_manifest(p)
    lay = EngramLayout.from_config(LAB)
    assert [t.rows for t in m.tables] == lay.rows
    assert m.tables[0].hash["multipliers"] == lay.multipliers[0]
    built = build_manifest(LAB, tmp_path, revision="synthetic-seed1", workers=2)
    assert built.to_dict() == m.to_dict()


def test_header_too_long_goes_to_next_page() -> None:
    meta = {"x": "y" * 1000}
    head = synthetic.table_header_bytes(1, 10, 256, 8, 664, meta)
    assert len(head) == 664 + 4096


def test_bad_shards(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    with pytest.raises(VerificationError, match="does not exist"):
        shards.read_safetensors_header(p)
    p.write_bytes(b"\x01")
    with pytest.raises(VerificationError, match="too short"):
        shards.read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 10) + b"{")
    with pytest.raises(VerificationError, match="truncated"):
        shards.read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 2) + b"{x")
    with pytest.raises(VerificationError, match="not valid JSON"):
        shards.read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(VerificationError, match="not a JSON object"):
        shards.read_safetensors_header(p)
    p.write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(VerificationError, match="not found"):
        shards.table_regions(p, 1)
    hdr = {
        "layers.1.engram.embed.weight": {"dtype": "BF16", "shape": [2, 256], "data_offsets": [0, 512]},
        "layers.1.engram.embed.scale": {"dtype": "F8_E8M0", "shape": [2, 8], "data_offsets": [512, 528]},
    }
    js = json.dumps(hdr).encode()
    p.write_bytes(struct.pack("<Q", len(js)) + js)
    with pytest.raises(VerificationError, match="must be F8_E4M3"):
        shards.table_regions(p, 1)


def test_unwritable_output(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(Dsv41Error, match="cannot create output directory"):
        synthetic.write_synthetic_tables(LAB, tmp_path / "f" / "sub", seed=1, rows_override=[10, 10])


def test_synthetic_rows_range() -> None:
    with pytest.raises(shards.RowRangeError):
        synthetic.synthetic_rows(0, 1, 10, np.asarray([10]))
