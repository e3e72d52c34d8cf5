"""What the RemoteRowSource tests share (test_remote_client.py, test_remote_deadlines.py): synthetic
tables of the lab model served by a RowServer on loopback, the exact local reader, random rows."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest

from dsv41.engram.manifest import load_manifest
from dsv41.engram.reader import LocalRowReader
from dsv41.engram.server import load_tables
from dsv41.engram.synthetic import write_synthetic_tables
from dsv41.transport import parse_url
from dsv41.transport.server import RowServer

#: The lab model's config (the package's data file), by absolute path: tests run in a tmp cwd.
LAB_MODEL = Path(__file__).resolve().parents[2] / "python" / "dsv41" / "data" / "lab_model.json"


@pytest.fixture(scope="module")
def tabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("t")
    cfg = json.loads(LAB_MODEL.read_text())
    cfg["engram_vocab_size"] = 300
    write_synthetic_tables(cfg, d, seed=9)
    m = load_manifest(d / "manifest.json")
    tables, _ = load_tables(m, d)
    return d, m, tables


def serve(tables, port=0):
    srv = RowServer(tables, [parse_url(f"tcp://127.0.0.1:{port}")])
    return srv, srv.start()[0]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def local(d, m):
    return LocalRowReader(m, d, threads=2)


def rand_rows(m, layer, n, seed=0):
    return np.random.default_rng(seed).integers(0, m.table(layer).rows, n)
