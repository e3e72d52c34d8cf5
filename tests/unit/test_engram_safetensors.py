"""Issue 10 item 4: every safetensors header the reference loader (safetensors.safe_open) refuses
is refused by dsv41 too - by shards.read_safetensors_header, `dsv41 engram manifest`,
`dsv41 engram verify`, the local reader and the table server's loader - naming file and tensor.

Each malformed case is also fed to safe_open, so the two are checked to agree."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from dsv41.cli import main
from dsv41.engram import manifest as mf, shards, synthetic
from dsv41.errors import Dsv41Error, VerificationError

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
ROWS = 40
W, S = shards.weight_name(1), shards.scale_name(1)
WB, SB = ROWS * 256, ROWS * 8


def _file(path: Path, header: dict | bytes, data_len: int, n: int | None = None) -> Path:
    js = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(js) if n is None else n) + js + bytes(data_len))
    return path


def _t(dtype: str, shape: list, offs: list) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offs}


GOOD = {W: _t("F8_E4M3", [ROWS, 256], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])}

# (id, header, data bytes after the header, header length override, text the error must contain)
CASES = [
    (
        "scale-overlaps-weight",
        {W: _t("F8_E4M3", [ROWS, 256], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [0, SB])},
        WB + SB,
        None,
        f"tensor {W}: data_offsets must be contiguous",
    ),
    (
        "gap-between-tensors",
        {W: _t("F8_E4M3", [ROWS, 256], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB + 8, WB + 8 + SB])},
        WB + 8 + SB,
        None,
        f"tensor {S}: data_offsets must be contiguous",
    ),
    (
        "not-from-zero",
        {W: _t("F8_E4M3", [ROWS, 256], [8, WB + 8]), S: _t("F8_E8M0", [ROWS, 8], [WB + 8, WB + 8 + SB])},
        WB + 8 + SB,
        None,
        f"tensor {W}: data_offsets must be contiguous",
    ),
    (
        "end-before-begin",
        {W: _t("F8_E4M3", [ROWS, 256], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB - 1])},
        WB + SB,
        None,
        f"tensor {S}: data_offsets must be contiguous",
    ),
    ("unindexed-tail", GOOD, WB + SB + 100, None, "unindexed tail"),
    ("data-past-end-of-file", GOOD, WB + SB - 1, None, "truncated"),
    (
        "dtype-shape-vs-bytes",
        {W: _t("F8_E4M3", [ROWS, 255], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])},
        WB + SB,
        None,
        f"tensor {W}: F8_E4M3 [{ROWS}, 255]",
    ),
    (
        "wider-dtype",
        {W: _t("BF16", [ROWS, 256], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])},
        WB + SB,
        None,
        f"tensor {W}: BF16",
    ),
    (
        "unknown-dtype",
        {W: _t("F8_E4M3X", [ROWS, 256], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])},
        WB + SB,
        None,
        f"tensor {W}: unknown dtype",
    ),
    (
        "negative-offset",
        {W: _t("F8_E4M3", [ROWS, 256], [-1, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])},
        WB + SB,
        None,
        f"tensor {W}: data_offsets",
    ),
    (
        "three-offsets",
        {W: _t("F8_E4M3", [ROWS, 256], [0, WB, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])},
        WB + SB,
        None,
        f"tensor {W}: data_offsets",
    ),
    (
        "float-shape",
        {W: _t("F8_E4M3", [ROWS, 256.0], [0, WB]), S: _t("F8_E8M0", [ROWS, 8], [WB, WB + SB])},
        WB + SB,
        None,
        f"tensor {W}: shape",
    ),
    ("metadata-not-strings", {"__metadata__": {"seed": 3}, **GOOD}, WB + SB, None, "__metadata__"),
    ("header-past-file-end", GOOD, 0, 1 << 20, "runs past the end"),
    ("header-over-limit", GOOD, WB + SB, 100_000_001, "exceeds 100000000"),
    ("header-not-json", b'{"a": ', WB + SB, None, "not valid JSON"),
    ("header-not-utf8", b'{"\xff": 1}', WB + SB, None, "not valid JSON"),
    ("header-not-object", b"[1, 2]", 0, None, "not a JSON object"),
    ("entry-not-object", {W: 3, S: _t("F8_E8M0", [ROWS, 8], [0, SB])}, SB, None, f"tensor {W}: header entry"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_loader_and_dsv41_both_refuse(tmp_path: Path, case) -> None:
    _, header, data_len, n, text = case
    p = _file(tmp_path / "model-00047-of-00048.safetensors", header, data_len, n)
    with pytest.raises(Exception):  # noqa: B017 - the loader raises SafetensorError / OSError
        with safe_open(str(p), framework="numpy"):
            pass
    with pytest.raises(VerificationError) as ei:
        shards.read_safetensors_header(p)
    msg = str(ei.value)
    assert msg.startswith(str(p)) and text in msg, msg
    with pytest.raises(VerificationError):
        shards.table_regions(p, 1)


@pytest.mark.parametrize("lead", [b"", b" "], ids=["plain", "leading-space"])
def test_good_header_is_accepted_by_both(tmp_path: Path, lead: bytes) -> None:
    p = _file(
        tmp_path / "good.safetensors", lead + json.dumps({"__metadata__": {"format": "pt"}, **GOOD}).encode(), WB + SB
    )
    with safe_open(str(p), framework="numpy") as f:
        assert sorted(f.keys()) == sorted([W, S])
    n, hdr = shards.read_safetensors_header(p)
    assert sorted(k for k in hdr if k != "__metadata__") == sorted([W, S])
    assert shards.table_regions(p, 1) == {
        "rows": ROWS,
        "weight_offset": 8 + n,
        "weight_bytes": 256,
        "scale_offset": 8 + n + WB,
        "scale_bytes": 8,
    }


def test_duplicate_key_is_refused(tmp_path: Path) -> None:
    """JSON with a tensor named twice: Python's json keeps the last silently; dsv41 refuses."""
    js = json.dumps(GOOD)[:-1] + ", " + json.dumps({W: GOOD[W]})[1:]
    p = _file(tmp_path / "dup.safetensors", js.encode(), WB + SB)
    with pytest.raises(VerificationError, match=f"key '{W}' appears twice"):
        shards.read_safetensors_header(p)


# ---------------------------------------------------------------- the case, end to end


def _overlap_scale_in_place(shard: Path, rows: int) -> None:
    """Rewrite a make-tables shard's header (same length, space padded) so the scale tensor sits
    at data_offsets [0, rows*8], over the weight, leaving the tail unindexed."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8 : 8 + n])
    layer = next(k for k in hdr if k.endswith(".scale"))
    hdr[layer]["data_offsets"] = [0, rows * 8]
    js = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(js) <= n
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(js + b" " * (n - len(js)))


def _rehash_file_record(man: mf.Manifest, d: Path, name: str) -> None:
    """Make the manifest's byte hashes match the (malformed) file, so only the header is wrong."""
    rec = man.file(name)
    data = (d / name).read_bytes()
    cs = rec["chunk_size"]
    rec.update(
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        chunks=[hashlib.sha256(data[i : i + cs]).hexdigest() for i in range(0, len(data), cs)],
    )


@pytest.fixture
def overlapped(tmp_path: Path):
    d = tmp_path / "t"
    synthetic.write_synthetic_tables(LAB, d, seed=2, rows_override=[300, 200], chunk_size=1 << 16)
    man = mf.load_manifest(d / "manifest.json")
    t = man.tables[0]
    _overlap_scale_in_place(d / t.file, t.rows)
    _rehash_file_record(man, d, t.file)
    man.save(d / "manifest.json")
    return d, t


def test_overlapping_scale_refused_everywhere(overlapped, capsys) -> None:
    d, t = overlapped
    p = d / t.file
    with pytest.raises(Exception):  # noqa: B017 - the reference loader refuses it
        with safe_open(str(p), framework="numpy"):
            pass
    want = f"{t.file}: tensor {t.weight_name}: data_offsets must be contiguous"
    # dsv41 engram manifest (build from the shards)
    rc = main(
        ["engram", "manifest", "--config", str(LAB), "--data", str(d), "--revision", "x", "--out", str(d / "m2.json")]
    )
    err = capsys.readouterr().err
    assert rc == 1 and want in err and "Traceback" not in err and not (d / "m2.json").exists()
    # dsv41 engram verify (bytes match the manifest; the header does not pass)
    rc = main(["engram", "verify", "--manifest", str(d / "manifest.json")])
    err = capsys.readouterr().err
    assert rc == 1 and want in err and "Traceback" not in err
    man = mf.load_manifest(d / "manifest.json")
    with pytest.raises(VerificationError, match=want):
        mf.verify(man, d, progress=False)
    # the local reader refuses to read rows of the shard
    from dsv41.engram.reader import LocalRowReader

    with LocalRowReader(man, d, threads=1) as r, pytest.raises(VerificationError, match=want):
        r.read(t.layer_id, np.asarray([0, 1]))
    # the table server's loader
    from dsv41.engram.server import load_tables

    with pytest.raises(Dsv41Error, match=want):
        load_tables(man, d)
