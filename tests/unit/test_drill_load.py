"""The drill's load generator (:class:`dsv41.harness.drill_measure.Load`) against a stand-in
streaming endpoint on loopback: a real short run through the bench client.

Before this test nothing below the 4-minute lab drill drove ``Load``: a changed signature of
``bench._client`` broke every drill and only the lab caught it (``make lint`` now checks call
signatures statically too: tests/unit/test_lint_calls.py).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dsv41.harness import bench, drill_measure
from serverutil import StreamingEndpoint


@pytest.fixture
def endpoint():
    ep = StreamingEndpoint()
    yield ep
    ep.close()


def _spec(**over) -> dict:
    return dict(bench.load_spec(env={}), timeout_s=5, **over)


def test_load_sends_counts_and_stops(endpoint: StreamingEndpoint) -> None:
    t_origin = time.monotonic()
    load = drill_measure.Load(endpoint.url, "dsv41-lab", _spec(), 2, lambda: time.monotonic() - t_origin).start()
    time.sleep(0.5)
    t_stop = time.monotonic()
    results = load.stop()
    assert time.monotonic() - t_stop < 2.0  # stop waits only for the requests in flight
    assert not any(t.is_alive() for t in load._threads)
    n = len(results)
    assert n >= 4, n
    assert all(r["ok"] for r in results), [r["error"] for r in results if not r["ok"]][:3]
    # every request the server saw is counted, none after stop() returned
    time.sleep(0.1)
    assert len(endpoint.bodies) == n
    assert [r["t_start"] for r in results] == sorted(r["t_start"] for r in results)
    assert all(0 <= r["t_start"] <= r["t_end"] for r in results)
    assert all(r["completion_tokens"] == 4 and r["finish_reason"] == "length" for r in results)
    # a fresh seed and cache salt per request, the spec's prompts in turn, the given model
    seeds = [b["seed"] for b in endpoint.bodies]
    salts = [b["cache_salt"] for b in endpoint.bodies]
    assert len(set(seeds)) == n and len(set(salts)) == n and all(s.startswith("drill-") for s in salts)
    assert {b["model"] for b in endpoint.bodies} == {"dsv41-lab"} and all(b["stream"] for b in endpoint.bodies)
    planned = {it["prompt"] for it in load.items}
    assert {b["prompt"] for b in endpoint.bodies} <= planned and len({b["prompt"] for b in endpoint.bodies}) >= 2


def test_no_cache_salt_when_the_spec_turns_it_off(endpoint: StreamingEndpoint) -> None:
    load = drill_measure.Load(endpoint.url, "m", _spec(cache_salt=False), 1, time.monotonic).start()
    time.sleep(0.2)
    results = load.stop()
    assert results and all(r["ok"] for r in results)
    assert all("cache_salt" not in b for b in endpoint.bodies)


def _refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connect() is refused at once
    return port


def test_a_refused_connection_is_a_failed_result_with_a_clear_error() -> None:
    load = drill_measure.Load(f"http://127.0.0.1:{_refused_port()}", "m", _spec(), 2, time.monotonic).start()
    time.sleep(0.5)
    results = load.stop()
    assert results
    assert all(not r["ok"] and r["status"] is None for r in results)
    assert all(r["error"].startswith("ConnectError: ") and "refused" in r["error"].lower() for r in results), results[
        0
    ]["error"]
    # each stream paused FAILED_PAUSE_S after each failure instead of spinning
    assert len(results) <= 2 * (0.5 / drill_measure.FAILED_PAUSE_S + 2), len(results)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "ftp://127.0.0.1/", "http://[::1"])
def test_a_malformed_endpoint_is_refused_in_one_line_before_any_thread(url: str) -> None:
    before = threading.active_count()
    with pytest.raises(bench.BenchError) as info:
        drill_measure.Load(url, "m", _spec(), 2, time.monotonic)
    assert "\n" not in str(info.value) and str(info.value)
    assert threading.active_count() == before
