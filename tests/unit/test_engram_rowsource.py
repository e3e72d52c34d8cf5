"""RowSource: the whole contract of every row source, local source counters, environment parsing,
remote construction (``sources.from_env``)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dsv41 import envs
from dsv41.engram import reader, synthetic
from dsv41.engram.manifest import load_manifest
from dsv41.engram.rowsource import (
    COUNTER_KEYS,
    LocalRowSource,
    RemoteURL,
    RowSource,
    parse_remote_env,
    parse_remote_url,
)
from dsv41.engram.sources import from_env
from dsv41.errors import ConfigError, Dsv41Error

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rs")
    synthetic.write_synthetic_tables(LAB, d, seed=2, rows_override=[3000, 2000], chunk_size=1 << 20)
    return d


def test_local_source_from_empty_env(data: Path) -> None:
    for env in ({}, {"DSV41_ENGRAM_REMOTE": ""}, {"DSV41_ENGRAM_REMOTE": "  ", "DSV41_ENGRAM_REMOTE_REQUIRED": "0"}):
        src = from_env(data / "manifest.json", data, 0, 2, settings=envs.parse(env))
        assert isinstance(src, LocalRowSource) and isinstance(src, RowSource)
        ids = np.asarray([1, 2999, 7])
        np.testing.assert_array_equal(src.lookup(1, ids), synthetic.synthetic_rows(2, 1, 3000, ids))
        src.lookup(2, np.asarray([0]))
        c = src.counters()
        assert set(COUNTER_KEYS) <= set(c)
        assert (c["lookups"], c["rows"], c["latency_count"], c["fallbacks"]) == (2, 4, 2, 0)
        assert c["latency_sum_s"] > 0 and c["source"] == "local"
        src.close()


def test_local_needs_data_dir(data: Path) -> None:
    with pytest.raises(ConfigError, match="no data directory"):
        from_env(data / "manifest.json", None, 0, 1, settings=envs.parse({}))


@pytest.mark.parametrize(
    "url,want",
    [
        ("tcp://198.18.1.1:7000", RemoteURL("tcp", "198.18.1.1", 7000)),
        ("nixl://x86host:7001@198.18.1.2", RemoteURL("nixl", "x86host", 7001, "198.18.1.2")),
        ("tcp://[::1]:9", RemoteURL("tcp", "::1", 9)),
    ],
)
def test_parse_url(url: str, want: RemoteURL) -> None:
    assert parse_remote_url(url) == want
    assert parse_remote_url(str(want)) == want


@pytest.mark.parametrize(
    "url,msg",
    [
        ("198.18.1.1:7000", "expected tcp://HOST:PORT"),
        ("http://h:1", "scheme must be one of tcp, nixl"),
        ("tcp://h", "missing :PORT"),
        ("tcp://h:0", "1..65535"),
        ("tcp://h:x", "not a number"),
        ("tcp://h:70000", "out of range"),
        ("tcp://:5", "empty host"),
        ("tcp://bad_host!:5", "bad host"),
        ("tcp://h:5@", "empty local address"),
        ("tcp://h:5@1.2.3.4:9", "takes no port"),
        ("tcp://[::1:5", "unclosed"),
    ],
)
def test_parse_url_errors(url: str, msg: str) -> None:
    with pytest.raises(ConfigError, match="^DSV41_ENGRAM_REMOTE: .*" + msg):
        parse_remote_url(url)


@pytest.mark.parametrize(
    "env,msg",
    [
        ({"DSV41_ENGRAM_REMOTE": "tcp://a:1"}, "names 1 URL.*tp is 2"),
        ({"DSV41_ENGRAM_REMOTE": "tcp://a:1,tcp://b:1,tcp://c:1"}, "names 3 URL"),
        (
            {"DSV41_ENGRAM_REMOTE": "tcp://a:1,tcp://b:1", "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "0"},
            r"integer in \[1, 600000\]",
        ),
        (
            {"DSV41_ENGRAM_REMOTE": "tcp://a:1,tcp://b:1", "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "1.5"},
            r"integer in \[1, 600000\]",
        ),
        ({"DSV41_ENGRAM_REMOTE": "tcp://a:1,tcp://b:1", "DSV41_ENGRAM_REMOTE_REQUIRED": "maybe"}, "0 or 1"),
        ({"DSV41_ENGRAM_REMOTE_REQUIRED": "1"}, "DSV41_ENGRAM_REMOTE is empty"),
    ],
)
def test_env_errors(env: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        parse_remote_env(env, 2)


def test_env_defaults() -> None:
    urls, t, req = parse_remote_env({"DSV41_ENGRAM_REMOTE": " tcp://a:1@10.0.0.1 , nixl://b:2 "}, 2)
    assert [str(u) for u in urls] == ["tcp://a:1@10.0.0.1", "nixl://b:2"]
    assert (t, req) == (100, False)
    assert parse_remote_env(
        {
            "DSV41_ENGRAM_REMOTE": "tcp://a:1",
            "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "250",
            "DSV41_ENGRAM_REMOTE_REQUIRED": "1",
        },
        1,
    )[1:] == (250, True)


def test_rank_tp_errors(data: Path) -> None:
    with pytest.raises(ConfigError, match="rank"):
        from_env(data / "manifest.json", data, 2, 2, settings=envs.parse({}))
    with pytest.raises(ConfigError, match="tp"):
        from_env(data / "manifest.json", data, 0, 0, settings=envs.parse({}))


def test_remote_constructs_client(data: Path, monkeypatch) -> None:
    seen = {}

    class Fake:
        def __init__(
            self,
            urls,
            manifest,
            rank,
            tp,
            timeout_ms,
            required,
            local=None,
            deadline_ms=None,
            fault_delay_ms=0.0,
            spin_us=None,
        ):
            seen.update(
                urls=urls,
                manifest=manifest,
                rank=rank,
                tp=tp,
                timeout_ms=timeout_ms,
                required=required,
                local=local,
                deadline_ms=deadline_ms,
                fault_delay_ms=fault_delay_ms,
                spin_us=spin_us,
            )

    mod = types.ModuleType("dsv41.engram.client")
    mod.RemoteRowSource = Fake
    monkeypatch.setitem(sys.modules, "dsv41.engram.client", mod)
    env = {
        "DSV41_ENGRAM_REMOTE": "tcp://198.18.1.1:7000@198.18.1.2,nixl://198.18.2.1:7000",
        "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "50",
        "DSV41_ENGRAM_REMOTE_REQUIRED": "1",
    }
    src = from_env(load_manifest(data / "manifest.json"), data, 1, 2, settings=envs.parse(env))
    assert isinstance(src, Fake)  # not wrapped: the deadline lives in the remote source
    assert seen["urls"] == ["tcp://198.18.1.1:7000@198.18.1.2", "nixl://198.18.2.1:7000"]
    assert (seen["rank"], seen["tp"], seen["timeout_ms"], seen["required"]) == (1, 2, 50, True)
    # defaults: DSV41_ENGRAM_LOOKUP_DEADLINE_MS 1000, no fault delay, DSV41_TRANSPORT_CLIENT_SPIN_US 50
    assert (seen["deadline_ms"], seen["fault_delay_ms"], seen["spin_us"]) == (1000.0, 0.0, 50)
    from_env(
        load_manifest(data / "manifest.json"),
        data,
        1,
        2,
        settings=envs.parse(
            {
                **env,
                "DSV41_ENGRAM_LOOKUP_DEADLINE_MS": "250",
                "DSV41_ENGRAM_FAULT_DELAY_MS": "20",
                "DSV41_TRANSPORT_CLIENT_SPIN_US": "0",
            }
        ),
    )
    assert (seen["deadline_ms"], seen["fault_delay_ms"], seen["spin_us"]) == (250.0, 20.0, 0)
    seen["local"].close()
    assert isinstance(seen["local"], reader.LocalRowReader)
    seen["local"].close()
    from_env(data / "manifest.json", None, 0, 2, settings=envs.parse(env))
    assert seen["local"] is None


def test_remote_without_client(data: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "dsv41.engram.client", None)
    with pytest.raises(ConfigError, match="dsv41.engram.client is not installed"):
        from_env(data / "manifest.json", data, 0, 1, settings=envs.parse({"DSV41_ENGRAM_REMOTE": "tcp://a:1"}))


# ---- every row source states the whole contract ----------------------------------------------

PKG = REPO / "python" / "dsv41"
CONTRACT = ("lookup", "lookup_layers", "counters", "close")


def _row_source_classes() -> list[tuple[str, str]]:
    """``(module, class)`` of every row source defined in ``python/dsv41``, read from the code
    (ast): a class that names ``RowSource`` (or another row source) as a base, or that defines
    ``lookup(self, layer_id, ...)`` (the RowSource signature, whatever its bases say)."""
    import ast

    classes: dict[tuple[str, str], tuple[set[str], bool]] = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = ".".join(("dsv41", *path.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
            looks = any(
                isinstance(f, ast.FunctionDef)
                and f.name == "lookup"
                and len(f.args.args) > 1
                and f.args.args[1].arg == "layer_id"
                for f in node.body
            )
            classes[(mod, node.name)] = (bases, looks)
    found = {k for k, (bases, looks) in classes.items() if looks or "RowSource" in bases}
    while True:  # subclasses of a row source are row sources
        more = {k for k, (bases, _) in classes.items() if k not in found and bases & {n for _, n in found}}
        if not more:
            return sorted(found)
        found |= more


def _params(fn) -> list[tuple[str, object, object]]:
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_enumeration_finds_the_row_sources() -> None:
    names = {c for _, c in _row_source_classes()}
    # a lower bound only (the enumeration reads the code): the local, remote and drafter sources
    assert {"LocalRowSource", "RemoteRowSource", "SyntheticRowSource"} <= names
    assert "RowSource" in names


@pytest.mark.parametrize("mod, name", _row_source_classes())
def test_every_row_source_implements_the_whole_contract(mod: str, name: str) -> None:
    """Subclasses RowSource (so the protocol's default ``lookup_layers`` is there and a missing
    method fails at construction), is concrete, and takes every method with the protocol's
    parameters: ``lookup(layer_id, rows, out=None)``, ``lookup_layers(layer_ids, rows,
    outs=None)``, ``counters()``, ``close()``. Callers rely on it instead of probing."""
    import importlib
    import inspect

    cls = getattr(importlib.import_module(mod), name)
    if cls is RowSource:
        return
    assert issubclass(cls, RowSource), f"{mod}.{name} defines lookup(layer_id, ...) but is not a RowSource"
    assert not inspect.isabstract(cls), f"{mod}.{name} leaves {sorted(cls.__abstractmethods__)} abstract"
    for meth in CONTRACT:
        assert _params(getattr(cls, meth)) == _params(getattr(RowSource, meth)), (mod, name, meth)


def test_default_lookup_layers_one_lookup_per_layer_into_outs(data: Path) -> None:
    src = LocalRowSource(reader.LocalRowReader(load_manifest(data / "manifest.json"), data, threads=1))
    ids = [np.asarray([0, 5, 2999]), np.asarray([7])]
    want = [synthetic.synthetic_rows(2, 1, 3000, ids[0]), synthetic.synthetic_rows(2, 2, 2000, ids[1])]
    got = src.lookup_layers([1, 2], ids)
    for g, w in zip(got, want, strict=False):
        np.testing.assert_array_equal(g, w)
    outs = [np.empty((3, 264), np.uint8), None]
    got = src.lookup_layers([1, 2], ids, outs)
    assert got[0] is outs[0]
    np.testing.assert_array_equal(outs[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert src.counters()["lookups"] == 4
    with pytest.raises(Dsv41Error, match="one row array"):
        src.lookup_layers([1, 2], ids[:1])
    with pytest.raises(Dsv41Error, match="one out"):
        src.lookup_layers([1, 2], ids, outs[:1])
    src.close()


def test_a_source_missing_a_method_fails_at_construction() -> None:
    class NoClose(RowSource):
        def lookup(self, layer_id, rows, out=None):
            return np.zeros((len(rows), 264), np.uint8)

        def counters(self):
            return {}

    with pytest.raises(TypeError, match="close"):
        NoClose()


def test_drafter_synthetic_source_rows_outs_counters() -> None:
    """The drafter's in-memory tables give ``make-tables --seed``'s rows through the contract."""
    import json

    from dsv41.drafter.train import SyntheticRowSource
    from dsv41.engram.shards import RowRangeError

    src = SyntheticRowSource(json.loads(LAB.read_text()), seed=3)
    L0, L1 = src.layout.layer_ids
    n0 = int(src.layout.rows[0])
    ids = np.asarray([0, 17, n0 - 1])
    want = synthetic.synthetic_rows(3, L0, n0, ids)
    np.testing.assert_array_equal(src.lookup(L0, ids), want)
    out = np.empty((3, 264), np.uint8)
    got = src.lookup_layers([L0, L1], [ids, np.asarray([4])], [out, None])
    assert got[0] is out
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(got[1], synthetic.synthetic_rows(3, L1, int(src.layout.rows[1]), [4]))
    c = src.counters()
    assert set(COUNTER_KEYS) <= set(c) and (c["lookups"], c["rows"], c["fallbacks"]) == (3, 7, 0)
    with pytest.raises(RowRangeError):
        src.lookup(L0, np.asarray([n0]))
    with pytest.raises(RowRangeError, match="no Engram table for layer 999"):
        src.lookup(999, ids)
    src.close()


def test_required_is_part_of_the_protocol_for_every_source_class() -> None:
    # callers (the vLLM overlay) ask ``source.is_required()`` without probing: every RowSource has it
    import dsv41.drafter.train as train
    import dsv41.engram.client as client
    import dsv41.engram.rowsource as rowsource

    classes = [
        c
        for m in (rowsource, client, train)
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, rowsource.RowSource)
    ]
    assert {c.__name__ for c in classes} >= {"RowSource", "LocalRowSource", "RemoteRowSource", "SyntheticRowSource"}
    for c in classes:
        assert callable(c.is_required), c
    assert rowsource.RowSource.is_required(None) is False and rowsource.LocalRowSource.is_required(None) is False
