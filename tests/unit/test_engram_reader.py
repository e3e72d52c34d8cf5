"""Local row reader (O_DIRECT + fallback) against safetensors slicing; sparse real geometry;
dequantization reference."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from dsv41.engram import shards, synthetic
from dsv41.engram.dequant import dequantize
from dsv41.engram.manifest import Manifest, TableEntry, load_manifest
from dsv41.engram.reader import LocalRowReader
from dsv41.engram.shards import RowRangeError
from dsv41.errors import Dsv41Error

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"
torch = pytest.importorskip("torch")
safe_open = pytest.importorskip("safetensors").safe_open


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("reader")
    synthetic.write_synthetic_tables(LAB, d, seed=11, rows_override=[40000, 5001], chunk_size=1 << 20)
    return d


def _oracle(path: Path, t, ids: np.ndarray) -> np.ndarray:
    out = np.empty((len(ids), 264), np.uint8)
    with safe_open(str(path), framework="pt") as f:
        w, s = f.get_slice(t.weight_name), f.get_slice(t.scale_name)
        for k, i in enumerate(ids.tolist()):
            out[k, :256] = w[i : i + 1].view(torch.uint8).numpy()[0]
            out[k, 256:] = s[i : i + 1].view(torch.uint8).numpy()[0]
    return out


def _straddlers(t) -> np.ndarray:
    i = np.arange(min(t.rows, 4096))
    return i[((t.weight_offset + 256 * i) % 4096) > 4096 - 256]


@pytest.mark.parametrize("direct,threads", [(True, 4), (False, 1), (True, 1)])
def test_reader_equals_safetensors(data: Path, direct: bool, threads: int) -> None:
    m = load_manifest(data / "manifest.json")
    rng = np.random.default_rng(direct * 10 + threads)
    with LocalRowReader(m, data, threads=threads, direct=direct) as r:
        opened_direct = r.is_direct(1)
        for t in m.tables:
            strad = _straddlers(t)
            assert strad.size and strad[0] == 13  # weight region at 664: row 13 crosses 4096
            ids = np.concatenate(
                [[0, t.rows - 1, t.rows - 1, 0], strad[:5], rng.integers(0, t.rows, 300), np.arange(100, 140)]
            )  # duplicates, and a dense run to coalesce
            got = r.read(t.layer_id, ids)
            np.testing.assert_array_equal(got, _oracle(data / t.file, t, ids))
            assert got.shape == (len(ids), 264) and got.dtype == np.uint8
        assert r.stats["rows"] > 0 and r.stats["reads"] > 0
        # a file opened O_DIRECT stays O_DIRECT: every read was aligned (no silent fallback)
        assert r.is_direct(1) == opened_direct and r.is_direct(2) == r.is_direct(1)
        if not direct:
            assert not opened_direct


def test_out_buffer_and_empty(data: Path) -> None:
    m = load_manifest(data / "manifest.json")
    with LocalRowReader(m, data, threads=2) as r:
        out = np.zeros((3, 264), np.uint8)
        assert r.read(1, np.asarray([5, 6, 7]), out=out) is out
        np.testing.assert_array_equal(out, synthetic.synthetic_rows(11, 1, 40000, np.asarray([5, 6, 7])))
        assert r.read(2, np.asarray([], np.int64)).shape == (0, 264)
        with pytest.raises(Dsv41Error, match="out must be"):
            r.read(1, np.asarray([1]), out=np.zeros((2, 264), np.uint8))
        with pytest.raises(Dsv41Error, match="out must be"):
            r.read(1, np.asarray([1]), out=np.zeros((1, 264), np.int16))


def test_row_range_errors(data: Path) -> None:
    m = load_manifest(data / "manifest.json")
    r = LocalRowReader(m, data, threads=1)
    with pytest.raises(RowRangeError, match=r"row 40000 is outside layer 1's table \[0, 40000\)"):
        r.read(1, np.asarray([3, 40000]))
    with pytest.raises(RowRangeError, match="row -1"):
        r.read(1, np.asarray([-1]))
    with pytest.raises(RowRangeError, match="no Engram table for layer 7"):
        r.read(7, np.asarray([1]))
    with pytest.raises(RowRangeError, match="1-D integer"):
        r.read(1, np.asarray([1.5]))
    with pytest.raises(RowRangeError, match="no table for layer 9"):
        m.table(9)
    r.close()
    r.close()
    with pytest.raises(Dsv41Error, match="closed"):
        r.read(1, np.asarray([1]))
    with pytest.raises(Dsv41Error, match="threads"):
        LocalRowReader(m, data, threads=0)


def test_missing_file(data: Path, tmp_path: Path) -> None:
    m = load_manifest(data / "manifest.json")
    with LocalRowReader(m, tmp_path) as r, pytest.raises(Dsv41Error, match="does not exist"):
        r.read(1, np.asarray([1]))


def test_fallback_when_odirect_refused_at_open(data: Path, monkeypatch) -> None:
    m = load_manifest(data / "manifest.json")
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with LocalRowReader(m, data, threads=2) as r:
        ids = np.asarray([0, 13, 39999])
        np.testing.assert_array_equal(r.read(1, ids), synthetic.synthetic_rows(11, 1, 40000, ids))
        assert r.is_direct(1) is False


def test_fallback_when_odirect_read_refused(data: Path, monkeypatch) -> None:
    m = load_manifest(data / "manifest.json")
    real = os.preadv
    calls = {"n": 0}

    def flaky(fd, bufs, off, *a):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off, *a)

    with LocalRowReader(m, data, threads=1) as r:
        if not r.is_direct(1):
            pytest.skip("this file system refuses O_DIRECT at open already")
        monkeypatch.setattr(os, "preadv", flaky)
        ids = np.asarray([0, 13, 39999])
        np.testing.assert_array_equal(r.read(1, ids), synthetic.synthetic_rows(11, 1, 40000, ids))
        assert r.is_direct(1) is False


def test_other_read_error_is_clear(data: Path, monkeypatch) -> None:
    m = load_manifest(data / "manifest.json")

    def eio(*a):
        raise OSError(errno.EIO, "Input/output error")

    with LocalRowReader(m, data, threads=1) as r:
        monkeypatch.setattr(os, "preadv", eio)
        with pytest.raises(Dsv41Error, match="Input/output error"):
            r.read(1, np.asarray([1]))


REAL_ROWS = 384006168


def test_sparse_real_geometry(tmp_path: Path) -> None:
    """Full-size layer-1 header, file mostly holes; rows beyond 2^32 and 2^36 bytes."""
    p = tmp_path / "model-00047-of-00048.safetensors"
    head = synthetic.table_header_bytes(1, REAL_ROWS, 256, 8, 664, {"format": "pt"})
    size = len(head) + REAL_ROWS * 264
    with open(p, "wb") as f:
        f.write(head)
    os.truncate(p, size)
    reg = shards.table_regions(p, 1)
    assert reg["weight_offset"] == 664 and reg["rows"] == REAL_ROWS
    t = TableEntry(
        layer_id=1,
        file=p.name,
        weight_name=shards.weight_name(1),
        scale_name=shards.scale_name(1),
        rows=REAL_ROWS,
        row_bytes=264,
        weight_bytes=256,
        scale_bytes=8,
        weight_offset=reg["weight_offset"],
        scale_offset=reg["scale_offset"],
        weight_sha256="0" * 64,
        scale_sha256="0" * 64,
        hash={},
        identity="0" * 64,
    )
    written = np.asarray([0, 13, (1 << 24) + 5, (1 << 28) + 77, 300_000_013, REAL_ROWS - 1])
    assert 664 + 256 * written[2] > 2**32 and 664 + 256 * written[3] > 2**36 and t.scale_offset > 2**36
    rng = np.random.default_rng(3)
    want = rng.integers(0, 256, (len(written), 264), dtype=np.uint8)
    with open(p, "r+b") as f:
        for i, row in zip(written.tolist(), want, strict=False):
            f.seek(t.weight_offset + 256 * i)
            f.write(row[:256].tobytes())
            f.seek(t.scale_offset + 8 * i)
            f.write(row[256:].tobytes())
    assert os.stat(p).st_blocks * 512 < 64 << 20  # really sparse
    ids = np.concatenate([written, [12345678, 2**28 + 4096]])
    with LocalRowReader(Manifest("sparse", {}, [], [t]), tmp_path, threads=4) as r:
        got = r.read(1, ids)
    np.testing.assert_array_equal(got[: len(written)], want)
    assert not got[len(written) :].any()
    # beyond 2^36 the byte offsets only fit int64: check the reader computed them as such
    assert int(t.scale_offset + 8 * written[-1]) + 8 == size


def _torch_dequant(rows: np.ndarray, convention: str):
    w = torch.from_numpy(rows[:, :256].copy()).view(torch.float8_e4m3fn).to(torch.float32)
    s = torch.from_numpy(rows[:, 256:].copy()).to(torch.float32)
    sc = torch.exp2(s - 127.0)
    if convention == "reference":
        sc[s == 255] = float("nan")
    else:
        sc[s == 0] = 0.0
        sc[s == 255] = float("inf")
    return (w.view(-1, 8, 32) * sc[:, :, None]).view(-1, 256).to(torch.bfloat16)


@pytest.mark.parametrize("convention", ["reference", "vllm"])
def test_dequantize(convention: str) -> None:
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, (64, 264), dtype=np.uint8)
    rows[:, :256][(rows[:, :256] & 0x7F) == 0x7F] = 0x11
    rows[:, 256:] = rng.integers(100, 140, (64, 8), dtype=np.uint8)
    rows[0, 256] = 0
    rows[0, 0] = 0x70  # E4M3 128.0
    rows[1, 257] = 255
    rows[2, 258] = 0
    tb, counts = dequantize(rows, convention)
    assert counts == {"convention": convention, "scale_zero": 2, "scale_255": 1}
    ref = _torch_dequant(rows, convention)
    assert tb.dtype == torch.bfloat16 and tb.shape == (64, 256)
    assert torch.equal(tb.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])
    assert torch.equal(tb.isnan(), ref.isnan())
    nb, _ = dequantize(rows, convention, backend="numpy")
    assert nb.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(nb), ref.isnan().numpy())
    ok = ~np.isnan(nb)
    np.testing.assert_array_equal(nb[ok], ref.to(torch.float32).numpy()[ok])
    if convention == "reference":
        assert np.isnan(nb[1, 32:64]).all() and nb[0, 0] == 2.0**-120  # 128 * 2^-127
    else:
        assert (nb[0, :32] == 0).all()
        assert np.isinf(nb[1, 32:64][(rows[1, 32:64] & 0x7F) != 0]).all()


def test_dequantize_bad_input() -> None:
    with pytest.raises(Dsv41Error, match="uint8"):
        dequantize(np.zeros((2, 263), np.uint8))
    with pytest.raises(Dsv41Error, match="convention"):
        dequantize(np.zeros((2, 264), np.uint8), "x")
    with pytest.raises(Dsv41Error, match="backend"):
        dequantize(np.zeros((2, 264), np.uint8), backend="jax")


def test_short_read_is_clear(data: Path, tmp_path: Path) -> None:
    import shutil

    m = load_manifest(data / "manifest.json")
    t = m.table(2)
    shutil.copy(data / t.file, tmp_path / t.file)
    with LocalRowReader(m, tmp_path, threads=1) as r:
        assert r.read(2, np.asarray([0, 99])).shape == (2, 264)  # opened (header checked) while whole
        os.truncate(tmp_path / t.file, t.scale_offset + 8 * 100)  # then scales of rows >= 100 are gone
        # a shard changed under the reader serves nothing more, not even the rows still there
        for ids in ([0, 99], [t.rows - 1]):
            with pytest.raises(Dsv41Error, match=r"changed under the running reader \(size "):
                r.read(2, np.asarray(ids))
    # a shard already short when first opened is refused by its header check (safe_open refuses it too)
    with LocalRowReader(m, tmp_path, threads=1) as r, pytest.raises(Dsv41Error, match=f"{t.file}: truncated"):
        r.read(2, np.asarray([0]))


def test_other_row_geometry(tmp_path: Path) -> None:
    """head_dim 96: rows of 96+3 bytes do not divide a page (the generic gather path)."""
    import json

    cfg = json.loads(LAB.read_text())
    cfg["engram_head_dim"] = 96
    synthetic.write_synthetic_tables(cfg, tmp_path, seed=1, rows_override=[3000, 100], chunk_size=1 << 20)
    m = load_manifest(tmp_path / "manifest.json")
    assert m.tables[0].row_bytes == 99
    ids = np.asarray([0, 41, 42, 2999, 1500])
    with LocalRowReader(m, tmp_path, threads=2) as r:
        got = r.read(1, ids)
    np.testing.assert_array_equal(got, synthetic.synthetic_rows(1, 1, 3000, ids, wb=96, sb=3))
    vals, counts = dequantize(got, backend="numpy")
    assert vals.shape == (5, 96) and counts["convention"] == "reference"
