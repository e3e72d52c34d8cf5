"""``dsv41 qualify ...``: the probes of ``ansible-playbook qualify.yml`` (dsv41.entrypoints.qualify_host,
qualify_serving, qualify_controller; records and preflight: dsv41.entrypoints.qualify).

Each probe prints one JSON list of check records on its last stdout line and exits 0 whatever the
checks found (the records say pass / fail / skipped); bad input is one ``dsv41: error:`` line and
exit 1. ``preflight`` refuses a qualification (exit 1) before any host step runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dsv41 import fileio
from dsv41.errors import ConfigError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _json_arg(text: str, what: str):
    try:
        return fileio.loads_json(text)
    except ValueError as exc:
        raise ConfigError(f"{what}: not JSON ({exc})") from None


def _emit(records: list[dict]) -> None:
    print(fileio.dumps_json(records, nonfinite="null"))


@app.command("preflight")
def preflight_cmd(
    hosts: Annotated[
        str, typer.Option("--hosts", help="JSON {host: {var: value}}: the inventory variables a qualification reads.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Report directory (created; must be writable).")],
) -> None:
    """Refuse before any host is touched: a CHANGE_ME left in the inventory, no hosts, a report
    directory that cannot be written. Prints the directory."""
    from dsv41.entrypoints import qualify as Q

    doc = _json_arg(hosts, "--hosts")
    if not isinstance(doc, dict):
        raise ConfigError("--hosts: expected a JSON object {host: {var: value}}")
    print(Q.preflight(doc, out))


@app.command("peers")
def peers_cmd(
    host: Annotated[str, typer.Option("--host", help="Inventory name of this host.")],
    links: Annotated[str, typer.Option("--links", help="JSON list: this host's dsv41_links.")],
    count: Annotated[int, typer.Option("--count", help="Echo requests per peer.")] = 3,
) -> None:
    """links.peer_reachable per link: ICMP echo to the peer's link address from this end's."""
    from dsv41.entrypoints import qualify_host as H

    doc = _json_arg(links, "--links")
    if not isinstance(doc, list) or not all(isinstance(x, dict) and "name" in x for x in doc):
        raise ConfigError("--links: expected a JSON list of {name, address, peer_address}")
    if count < 1:
        raise ConfigError(f"--count must be >= 1, got {count}")
    _emit(H.probe_peers(host, doc, count=count))


def _url(env_file: Path, rank: int) -> str | None:
    from dsv41.entrypoints import qualify_host as H

    return H.rank_url(H.read_env_file(env_file), rank)


@app.command("transport")
def transport_cmd(
    host: Annotated[str, typer.Option("--host")],
    link: Annotated[str, typer.Option("--link", help="Name of the offload link the URL runs over.")],
    rank: Annotated[int, typer.Option("--rank")],
    backend: Annotated[str, typer.Option("--backend", help="Production backend: nixl (RDMA) or tcp.")],
    p50_max_us: Annotated[float, typer.Option("--p50-max-us", help="Ceiling of the decode lookup p50 (us).")],
    p99_max_us: Annotated[float, typer.Option("--p99-max-us", help="Ceiling of the decode lookup p99 (us).")],
    gbps_min: Annotated[float, typer.Option("--gbps-min", help="Floor of the 64 MiB transfer rate (Gb/s).")],
    env_file: Annotated[Path, typer.Option("--env-file")] = Path("/etc/dsv41/engram-overlay.env"),
    manifest: Annotated[Path, typer.Option("--manifest")] = Path("/opt/dsv41/tables/manifest.json"),
    tp: Annotated[int, typer.Option("--tp")] = 2,
    iters: Annotated[int, typer.Option("--iters", help="Decode-size lookups timed.")] = 2000,
    bw_mib: Annotated[int, typer.Option("--bw-mib", help="Transfer size (MiB).")] = 64,
    bw_seconds: Annotated[
        float, typer.Option("--bw-seconds", help="Least duration of the bandwidth transfers (s).")
    ] = 2.0,
    start_at: Annotated[
        float | None,
        typer.Option("--start-at", help="Epoch second the bandwidth transfers start (both links together)."),
    ] = None,
) -> None:
    """transport.* of this rank over its own link, on the URL its serving engine uses
    (DSV41_ENGRAM_REMOTE of the Engram env file)."""
    from dsv41.entrypoints import qualify as Q, qualify_host as H

    if backend not in ("nixl", "tcp"):
        raise ConfigError(f"--backend must be nixl or tcp, not {backend!r}")
    if iters < 10 or bw_mib < 1 or not 0 <= bw_seconds <= 600:
        raise ConfigError("--iters must be >= 10, --bw-mib >= 1 and --bw-seconds within [0, 600]")
    url = _url(env_file, rank)
    if url is None:
        _emit(
            Q.skipped(
                "transport",
                ("backend", "latency_p50", "latency_p99", "bandwidth", "late_reply_dropped", "refused_identity"),
                host,
                f"remote Engram is off on rank {rank} ({env_file} has no DSV41_ENGRAM_REMOTE)",
                subject=link,
            )
        )
        return
    _emit(
        H.probe_transport(
            host,
            link,
            url,
            str(manifest),
            rank,
            tp,
            backend=backend,
            p50_max_us=p50_max_us,
            p99_max_us=p99_max_us,
            gbps_min=gbps_min,
            iters=iters,
            bw_bytes=bw_mib << 20,
            bw_min_s=bw_seconds,
            start_at=start_at,
        )
    )


@app.command("sweep")
def sweep_cmd(
    host: Annotated[str, typer.Option("--host")],
    rank: Annotated[int, typer.Option("--rank")],
    lookups: Annotated[int, typer.Option("--lookups", help="Row ids per rank (both layers).")] = 839040,
    env_file: Annotated[Path, typer.Option("--env-file")] = Path("/etc/dsv41/engram-overlay.env"),
    manifest: Annotated[Path, typer.Option("--manifest")] = Path("/opt/dsv41/tables/manifest.json"),
    tp: Annotated[int, typer.Option("--tp")] = 2,
) -> None:
    """exactness.bad_rows per layer: the sweep of this rank over its production URL vs the local shards."""
    from dsv41.entrypoints import qualify as Q, qualify_host as H

    if lookups < 1:
        raise ConfigError(f"--lookups must be >= 1, got {lookups}")
    url = _url(env_file, rank)
    if url is None:
        _emit(
            [
                Q.record(
                    "exactness",
                    "bad_rows",
                    host,
                    None,
                    reason=f"remote Engram is off on rank {rank}",
                    subject=f"rank {rank}",
                )
            ]
        )
        return
    _emit(H.probe_sweep(host, url, str(manifest), rank, tp, lookups))


@app.command("serving-host")
def serving_host_cmd(
    host: Annotated[str, typer.Option("--host")],
    rank: Annotated[int, typer.Option("--rank")],
    runtime: Annotated[str, typer.Option("--runtime", help="serve_runtime: lab or vllm.")],
    required: Annotated[bool, typer.Option("--required/--not-required", help="Expected DSV41_ENGRAM_REMOTE_REQUIRED.")],
    pinned_max_bytes: Annotated[int, typer.Option("--pinned-max-bytes", help="Ceiling of Mlocked/Unevictable.")],
    image: Annotated[str, typer.Option("--image", help="serve_image (pinned by digest).")] = "",
    env_file: Annotated[Path, typer.Option("--env-file")] = Path("/etc/dsv41/engram-overlay.env"),
    container_runtime: Annotated[str, typer.Option("--container-runtime")] = "docker",
) -> None:
    """serving.* that read only this Spark: required mode, host memory; image, overlay contract,
    PIECEWISE and the overlay's start line with vLLM."""
    from dsv41.entrypoints import qualify_serving as S

    if runtime not in ("lab", "vllm"):
        raise ConfigError(f"--runtime must be lab or vllm, not {runtime!r}")
    _emit(
        S.probe_serving_host(
            host,
            rank,
            runtime=runtime,
            env_file=str(env_file),
            required=required,
            pinned_max_bytes=pinned_max_bytes,
            image=image,
            container_runtime=container_runtime,
        )
    )


RANK_METRICS_HELP = (
    "JSON runtime facts (the inventory's dsv41_rank_metrics: runtime, api_url, ranks, overlay_port): "
    "where each rank's counters are read. Left out: rank 0's /metrics."
)


def _rank_urls(facts: str) -> dict[str, str] | None:
    """``{rank: url}`` of ``--rank-metrics`` (None when empty); ConfigError on bad JSON or facts."""
    if not facts:
        return None
    from dsv41.harness import rank_metrics as RM

    try:
        return RM.urls(_json_arg(facts, "--rank-metrics"))
    except RM.RankMetricsError as exc:
        raise ConfigError(f"--rank-metrics: {exc}") from None


@app.command("serving")
def serving_cmd(
    api: Annotated[str, typer.Option("--api", help="Rank 0's base URL.")],
    refs: Annotated[Path, typer.Option("--refs", help="Recorded greedy references.")],
    ranks: Annotated[str, typer.Option("--ranks", help="Ranks that must count lookups, e.g. 0,1.")] = "0,1",
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds of traffic between the two counter reads.")
    ] = 10.0,
    rank_metrics: Annotated[str, typer.Option("--rank-metrics", help=RANK_METRICS_HELP)] = "",
) -> None:
    """serving.counters per rank over a measured interval of traffic, serving.greedy_refs 6/6."""
    from dsv41.entrypoints import qualify_controller as C

    if not interval > 0:
        raise ConfigError(f"--interval must be > 0, got {interval}")
    _emit(
        C.probe_serving(
            api,
            str(refs),
            host="localhost",
            ranks=[r.strip() for r in ranks.split(",") if r.strip()],
            interval_s=interval,
            rank_metrics=_rank_urls(rank_metrics),
        )
    )


@app.command("reconnect")
def reconnect_cmd(
    api: Annotated[str, typer.Option("--api")],
    ranks: Annotated[str, typer.Option("--ranks")] = "0,1",
    wait: Annotated[
        float, typer.Option("--wait", help="Seconds allowed for the ranks to serve remote rows again.")
    ] = 30.0,
    rank_metrics: Annotated[str, typer.Option("--rank-metrics", help=RANK_METRICS_HELP)] = "",
) -> None:
    """transport.reconnect per rank, right after the table server was restarted."""
    from dsv41.entrypoints import qualify_controller as C

    _emit(
        C.probe_reconnect(
            api,
            host="localhost",
            ranks=[r.strip() for r in ranks.split(",") if r.strip()],
            wait_s=wait,
            rank_metrics=_rank_urls(rank_metrics),
        )
    )


@app.command("fail-closed")
def fail_closed_cmd(
    api: Annotated[str, typer.Option("--api")],
    refs: Annotated[Path, typer.Option("--refs")],
    rank_metrics: Annotated[str, typer.Option("--rank-metrics", help=RANK_METRICS_HELP)] = "",
) -> None:
    """drafter.fail_closed, with the drafter worker stopped."""
    from dsv41.entrypoints import qualify_controller as C

    _emit(C.probe_fail_closed(api, str(refs), host="localhost", rank_metrics=_rank_urls(rank_metrics)))


@app.command("drafter-identity")
def drafter_identity_cmd(
    worker: Annotated[
        str,
        typer.Option(
            "--worker", help="JSON of `dsv41 drafter status --json` (left out: the worker's status could not be read)."
        ),
    ] = "",
    expected: Annotated[
        str,
        typer.Option(
            "--expected",
            help="JSON of `dsv41 drafter identity DIR` on rank 0 (left out: rank 0's identities could not be read).",
        ),
    ] = "",
) -> None:
    """drafter.worker_identity: the worker's identities equal rank 0's drafter files."""
    from dsv41.entrypoints import qualify_controller as C

    _emit(
        C.probe_drafter_identity(
            _json_arg(worker, "--worker") if worker else None,
            _json_arg(expected, "--expected") if expected else None,
            host="localhost",
        )
    )


@app.command("start-at")
def start_at_cmd(delay: Annotated[float, typer.Option("--delay", help="Seconds from now.")] = 8.0) -> None:
    """Print an epoch second ``--delay`` seconds from now: the common start of both links' transfers."""
    print(f"{time.time() + delay:.3f}")


@app.command("vllm-tiny")
def vllm_tiny_cmd(
    script: Annotated[Path, typer.Option("--script", help="tools/qualify_vllm_tiny.sh of this checkout.")],
    config: Annotated[Path, typer.Option("--config", help="The served checkpoint's config.json (REAL_CONFIG).")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed for the four serves.")] = 3600.0,
) -> None:
    """serving.vllm_tiny: run the tiny-model ``vllm serve`` qualification script on this CUDA host."""
    from dsv41.entrypoints import qualify_serving as S

    _emit([S.run_vllm_tiny(str(script), str(config), timeout_s=timeout)])
