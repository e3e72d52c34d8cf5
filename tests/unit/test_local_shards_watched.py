"""A rank's local Engram shards are verified before it says it is ready and watched while it
serves: a missing, truncated or changed shard is one clear reason (VerificationError naming the
file; ``dsv41 engine serve`` exits 1 with one line before it listens, never 200 then a crash),
and a shard truncated or rewritten in place under a running reader is detected before a row
read from it is returned (the reader reads with pread, so a truncation is an error, never a
SIGBUS). Every row source that reads local shards (``sources.from_env``: local, and the remote
source's exact fallback) is covered through :func:`dsv41.engram.sources.verify_local`."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from dsv41 import envs
from dsv41.engram import sources
from dsv41.engram.manifest import load_manifest
from dsv41.errors import VerificationError
from engineutil import PY, REPO, engine_env, free_port, lab_assets  # noqa: E402


@pytest.fixture()
def tables(tmp_path_factory, tmp_path):
    """A private copy of the lab tables (each test damages its own)."""
    ns = lab_assets(tmp_path_factory)
    d = tmp_path / "tables"
    shutil.copytree(ns.data, d)
    return ns, d


def _sources(manifest: Path, data: Path):
    """Every row source from_env builds that reads local shards: local, and remote with its exact
    fallback (its server is never contacted here)."""
    yield "local", sources.from_env(str(manifest), str(data), 0, 1, settings=envs.parse({}))
    remote = envs.parse({"DSV41_ENGRAM_REMOTE": "tcp://127.0.0.1:9"})
    yield "remote+fallback", sources.from_env(str(manifest), str(data), 0, 1, settings=remote)


def _shard(d: Path, manifest: Path) -> Path:
    return d / load_manifest(manifest).tables[0].file


def _damage(p: Path, how: str) -> None:
    if how == "missing":
        p.unlink()
    elif how == "truncated":
        os.truncate(p, p.stat().st_size // 2)
    elif how == "changed":  # same size, one byte of the last table region flipped
        with open(p, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("how", ["missing", "truncated", "changed"])
def test_a_bad_shard_fails_verification_with_one_reason(tables, how) -> None:
    ns, d = tables
    _damage(_shard(d, ns.manifest), how)
    for name, src in _sources(ns.manifest, d):
        try:
            with pytest.raises(VerificationError) as ei:
                sources.verify_local(src)
        finally:
            src.close()
        msg = str(ei.value)
        assert "\n" not in msg and _shard(d, ns.manifest).name in msg, (name, msg)


@pytest.mark.parametrize("how", ["truncated", "changed"])
def test_a_shard_changed_under_a_running_reader_is_never_served(tables, how) -> None:
    ns, d = tables
    m = load_manifest(ns.manifest)
    t = m.tables[0]
    ids = np.arange(min(t.rows, 64), dtype=np.int64)
    for _name, src in _sources(ns.manifest, d):
        try:
            assert sources.verify_local(src)
            reader = src.reader if hasattr(src, "reader") else src.local.reader
            good = reader.read(t.layer_id, ids)
            time.sleep(0.05)  # past the file system's timestamp tick
            _damage(d / t.file, how)
            with pytest.raises(VerificationError, match="changed under the running reader"):
                reader.read(t.layer_id, ids)
            with pytest.raises(VerificationError):  # and it stays failed
                reader.read(t.layer_id, ids)
            assert good.shape == (ids.size, t.row_bytes)
        finally:
            src.close()
        shutil.rmtree(d)
        shutil.copytree(ns.data, d)


def test_verify_local_finds_the_reader_of_every_source(tables) -> None:
    ns, d = tables
    for name, src in _sources(ns.manifest, d):
        try:
            assert sources.verify_local(src), name
        finally:
            src.close()


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_engine_serve_with_a_bad_shard_exits_with_one_line_and_never_listens(tables, how, tmp_path) -> None:
    ns, d = tables
    _damage(_shard(d, ns.manifest), how)
    port = free_port()
    cmd = [
        PY,
        "-m",
        "dsv41.cli",
        "engine",
        "serve",
        "--config",
        str(ns.config),
        "--weights",
        str(ns.weights),
        "--manifest",
        str(ns.manifest),
        "--data",
        str(d),
        "--port",
        str(port),
    ]
    p = subprocess.run(
        cmd, env=engine_env(PYTHONPATH=str(REPO / "python")), capture_output=True, timeout=120, cwd=str(REPO)
    )
    err = p.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.startswith("dsv41: error:")]
    assert p.returncode == 1 and len(lines) == 1 and _shard(d, ns.manifest).name in lines[0], err[-2000:]
    assert "Traceback" not in err
