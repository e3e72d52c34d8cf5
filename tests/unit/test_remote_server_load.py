"""Engram server loading: unaligned regions read exactly (O_DIRECT or buffered), sha256 checked
against the manifest, load progress, metrics and readiness endpoints."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dsv41.engram.manifest import load_manifest
from dsv41.engram.reader import LocalRowReader
from dsv41.engram.server import EngramServer, LoadProgress, load_region, load_tables, parse_hostport
from dsv41.engram.synthetic import write_synthetic_tables
from dsv41.errors import Dsv41Error, VerificationError
from dsv41.transport import open_client, protocol as P


def small_cfg(vocab=300):
    cfg = json.loads((Path(__file__).resolve().parents[2] / "python/dsv41/data/lab_model.json").read_text())
    cfg["engram_vocab_size"] = vocab
    return cfg


@pytest.fixture(scope="module")
def tables_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    write_synthetic_tables(small_cfg(), d, seed=5)
    return d


@pytest.mark.parametrize("offset,length", [(0, 4096), (664, 100000), (4095, 1), (12345, 3 * 4096 + 17), (1, 9 << 20)])
def test_load_region_exact(tmp_path, offset, length):
    data = np.random.default_rng(offset).integers(0, 256, offset + length + 5000, dtype=np.uint8).tobytes()
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    prog = LoadProgress()
    for direct in (True, False):
        r = load_region(p, offset, length, direct=direct, progress=prog, chunk=1 << 20)
        assert r.view.tobytes() == data[offset : offset + length]
        import hashlib

        assert r.sha256 == hashlib.sha256(data[offset : offset + length]).hexdigest()
        assert r.buf is not None
    assert prog.done == 2 * length


def _smaps_entry(addr: int) -> tuple[str, dict]:
    """The /proc/self/smaps header line of the mapping holding ``addr`` and its fields."""
    head, fields = None, {}
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if "-" in parts[0] and ":" not in parts[0]:
            if head is not None:
                break
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                head = line
        elif head is not None and parts[0].endswith(":"):
            fields[parts[0][:-1]] = parts[1:]
    assert head is not None, "mapping not found"
    return head, fields


def test_load_region_private_and_huge_page_eligible(tmp_path):
    """The table lands in a private anonymous mapping (a shared one is shmem, where
    MADV_HUGEPAGE does nothing with shmem THP off) that THP may back with 2 MiB pages."""
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(5 << 20))
    r = load_region(p, 0, 5 << 20)
    head, fields = _smaps_entry(r.view.ctypes.data)
    assert head.split()[1].endswith("p"), head  # rw-p: private
    assert "dc" in fields["VmFlags"]  # MADV_DONTFORK
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():  # a kernel with THP accepts MADV_HUGEPAGE
        assert "hg" in fields["VmFlags"], fields["VmFlags"]
        if "[madvise]" in thp.read_text() or "[always]" in thp.read_text():
            assert fields["THPeligible"] == ["1"], fields


def test_load_region_errors(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"x" * 5000)
    with pytest.raises(VerificationError, match="truncated: 5000 bytes"):
        load_region(p, 100, 10000)
    with pytest.raises(Dsv41Error, match="does not exist"):
        load_region(tmp_path / "missing.bin", 0, 10)


def test_load_tables_matches_local_reader(tables_dir):
    m = load_manifest(tables_dir / "manifest.json")
    prog = LoadProgress()
    tables, report = load_tables(m, tables_dir, progress=prog)
    assert prog.done == prog.total == sum(t.rows * 264 for t in m.tables)
    reader = LocalRowReader(m, tables_dir, threads=2)
    for t, entry in zip(tables, m.tables, strict=False):
        assert t.identity.hex() == entry.identity and t.rows == entry.rows
        rows = np.random.default_rng(1).integers(0, entry.rows, 500)
        want = reader.read(entry.layer_id, rows)
        np.testing.assert_array_equal(np.concatenate([t.weight[rows], t.scale[rows]], axis=1), want)
    reader.close()
    assert [r["layer_id"] for r in report["tables"]] == [1, 2]


def test_load_tables_detects_corruption(tables_dir, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(tables_dir, d)
    m = load_manifest(d / "manifest.json")
    t = m.tables[1]
    with open(d / t.file, "r+b") as f:
        f.seek(t.scale_offset + 8 * 3)
        b = f.read(1)
        f.seek(t.scale_offset + 8 * 3)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(VerificationError, match=f"layer {t.layer_id} scale region"):
        load_tables(m, d)
    (d / m.tables[0].file).unlink()
    with pytest.raises(Dsv41Error, match="does not exist"):
        load_tables(m, d)


def test_engram_server_metrics_ready_and_serving(tables_dir):
    m = load_manifest(tables_dir / "manifest.json")
    es = EngramServer(m, tables_dir, ["tcp://127.0.0.1:0"], metrics="127.0.0.1:0")
    es.start_metrics()
    base = f"http://{es.metrics_bound[0]}:{es.metrics_bound[1]}"
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(base + "/ready", timeout=5)
    assert ei.value.code == 503  # not loaded yet
    es.load()
    addr = es.listen()[0]
    assert urllib.request.urlopen(base + "/ready", timeout=5).status == 200
    ident = P.identity_bytes(m.tables[0].identity)
    c = open_client(addr, [ident])
    out = np.empty((4, 264), np.uint8)
    c.lookup_into(ident, np.arange(4, dtype=np.uint64), [out], 2.0)
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do: the row past the table must not be served
        c.lookup_into(ident, np.array([m.tables[0].rows], np.uint64), [out[:1]], 2.0)
    c.close()
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    assert "dsv41_engram_rows_served_total 4.0" in text
    assert 'dsv41_engram_refusals_total{reason="out_of_range"} 1.0' in text
    assert "dsv41_engram_ready 1.0" in text
    assert "dsv41_engram_request_seconds_count 1.0" in text
    total = sum(t.rows * 264 for t in m.tables)
    vals = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(vals["dsv41_engram_load_bytes"]) == float(vals["dsv41_engram_load_total_bytes"]) == total
    info = es.ready_info()
    assert info["listen"] == [str(addr)] and info["pid"] > 0
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(base + "/nope", timeout=5)
    es.stop(1)


def test_engram_server_bad_arguments(tables_dir):
    m = load_manifest(tables_dir / "manifest.json")
    with pytest.raises(Dsv41Error, match="at least one --listen"):
        EngramServer(m, tables_dir, [])
    with pytest.raises(Dsv41Error, match="scheme"):
        EngramServer(m, tables_dir, ["udp://127.0.0.1:1"])
    with pytest.raises(Dsv41Error, match="no @LOCAL"):
        EngramServer(m, tables_dir, ["tcp://127.0.0.1:0@127.0.0.1"])
    with pytest.raises(Dsv41Error):
        parse_hostport("nohost", "--metrics")
    es = EngramServer(m, tables_dir, ["tcp://127.0.0.1:0"], metrics="127.0.0.1:0")
    es.start_metrics()
    clash = EngramServer(m, tables_dir, ["tcp://127.0.0.1:0"], metrics=f"127.0.0.1:{es.metrics_bound[1]}")
    with pytest.raises(Dsv41Error, match="cannot listen for metrics"):
        clash.start_metrics()
    es.stop(0)
