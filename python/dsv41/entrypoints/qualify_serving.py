"""Host-side qualification probes of the serving group (``dsv41 qualify serving-host|vllm-tiny``):
on one Spark, through the inventory's own connection, the Engram required mode, the pinned host
memory, and with vLLM the running container's image, overlay contract, graph mode and activity;
the tiny vLLM run. Returns check records (``dsv41.entrypoints.qualify.record``); a check that
needs what the host lacks is ``skipped`` with the reason. The other host probes:
:mod:`dsv41.entrypoints.qualify_host`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from dsv41 import envs, fileio
from dsv41.entrypoints.qualify import QualifyError, record, skipped
from dsv41.entrypoints.qualify_host import read_env_file


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as ``{key: bytes}`` (kB values times 1024)."""
    out = {}
    for line in fileio.read_text(path, "the kernel's meminfo").splitlines():
        m = re.match(r"^(\w+):\s+(\d+)(?:\s+kB)?$", line.strip())
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if line.strip().endswith("kB") else 1)
    return out


def probe_serving_host(
    host: str,
    rank: int,
    *,
    runtime: str,
    env_file: str,
    required: bool,
    pinned_max_bytes: int,
    image: str = "",
    container: str = "dsv41-serve",
    container_runtime: str = "docker",
    unit: str = "dsv41-serve",
    meminfo_path: str = "/proc/meminfo",
    run: Callable | None = None,
) -> list[dict]:
    """Serving checks of one Spark that read only this host:

    - ``required_mode``: ``DSV41_ENGRAM_REMOTE_REQUIRED`` of the Engram env file is ``required``;
      with vLLM also ``dsv41 overlay active`` in the container's log;
    - ``host_memory``: ``Mlocked`` + ``Unevictable`` (bytes) at most ``pinned_max_bytes`` (the
      overlay's staging, far below the ~94 GiB per rank vLLM pins without it);
    - with ``runtime == 'vllm'``: ``image_digest`` (the running container's image is ``image``,
      pinned by ``@sha256:``), ``overlay_contract`` (plugin importable and ``contract.check_files``
      returns ``[]`` inside the container), ``piecewise`` (the unit carries
      ``"cudagraph_mode": "PIECEWISE"``); with the lab runtime these are skipped with the reason.
    """
    import subprocess

    run = run or (lambda argv: subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False))
    out = []
    env = read_env_file(env_file)
    try:
        val = "1" if envs.parse(env).engram_remote_required else "0"
    except envs.ConfigError as exc:
        val = f"invalid ({exc})"
    want = "1" if required else "0"
    out.append(
        record(
            "serving",
            "required_mode",
            host,
            val == want,
            val,
            want,
            subject=f"rank {rank}",
            reason=""
            if val == want
            else f"rank {rank}: {env_file} DSV41_ENGRAM_REMOTE_REQUIRED={val}, expected {want}",
        )
    )
    mi = meminfo(meminfo_path)
    pinned = max(mi.get("Mlocked", 0), mi.get("Unevictable", 0))
    ok = pinned <= pinned_max_bytes
    out.append(
        record(
            "serving",
            "host_memory",
            host,
            ok,
            {"mlocked": mi.get("Mlocked"), "unevictable": mi.get("Unevictable")},
            f"<= {pinned_max_bytes}",
            unit="bytes",
            subject=f"rank {rank}",
            reason=(
                "lab: the simulated hosts share one kernel, so this is the machine's figure"
                if runtime == "lab" and ok
                else ""
                if ok
                else f"rank {rank}: {pinned} B pinned, more than {pinned_max_bytes} B"
            ),
        )
    )
    names = ("image_digest", "overlay_contract", "piecewise")
    if runtime != "vllm":
        return out + skipped(
            "serving", names, host, f"serve_runtime {runtime}: no vLLM container on this host", subject=f"rank {rank}"
        )
    r = run([container_runtime, "inspect", "--format", "{{.Config.Image}}", container])
    running = r.stdout.strip() if r.returncode == 0 else None
    ok = running == image and "@sha256:" in image
    out.append(
        record(
            "serving",
            "image_digest",
            host,
            ok,
            running,
            image,
            subject=f"rank {rank}",
            reason=""
            if ok
            else f"rank {rank}: container {container} runs {running or 'nothing'}, expected {image} (pinned by digest)",
        )
    )
    code = (
        "from dsv41.overlay import contract as C; import json; "
        "print(json.dumps(C.check_files(C.load(), C.installed_vllm_root(), C.installed_version())))"
    )
    r = run([container_runtime, "exec", container, "python3", "-c", code])
    try:
        bad = fileio.loads_json(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    except (ValueError, IndexError):
        bad = None
    ok = bad == []
    out.append(
        record(
            "serving",
            "overlay_contract",
            host,
            ok,
            bad if bad is not None else (r.stderr or "").strip()[-200:],
            [],
            subject=f"rank {rank}",
            reason="" if ok else f"rank {rank}: overlay contract inside {container}: {bad}",
        )
    )
    r = run(["systemctl", "cat", unit])
    modes = re.findall(r'"cudagraph_mode"\s*:\s*"([A-Z_]+)"', r.stdout or "")
    ok = modes == ["PIECEWISE"] or (bool(modes) and set(modes) == {"PIECEWISE"})
    out.append(
        record(
            "serving",
            "piecewise",
            host,
            ok,
            modes,
            ["PIECEWISE"],
            subject=f"rank {rank}",
            reason="" if ok else f"rank {rank}: {unit} cudagraph_mode {modes or 'absent'}",
        )
    )
    r = run([container_runtime, "logs", "--tail", "2000", container])
    active = "dsv41 overlay active" in (r.stdout or "") + (r.stderr or "")
    out.append(
        record(
            "serving",
            "overlay_active",
            host,
            active,
            active,
            True,
            subject=f"rank {rank}",
            reason="" if active else f"rank {rank}: no 'dsv41 overlay active' in {container}'s log",
        )
    )
    return out


def run_vllm_tiny(script: str, config: str, timeout_s: float = 3600.0, host: str = "localhost") -> dict:
    """``serving.vllm_tiny``: ``tools/qualify_vllm_tiny.sh`` (four ``vllm serve`` runs of a tiny
    DeepSeek-V4.1-shaped model: overlay inert, FULL graphs refused, remote rows, exact local
    fallback with identical greedy text). Skipped without ``vllm`` on PATH or without a CUDA GPU
    (``nvidia-smi -L`` lists none); the record keeps the script's last lines."""
    import shutil
    import subprocess

    if shutil.which("vllm") is None:
        return record("serving", "vllm_tiny", host, None, reason="no vllm on PATH on this host")
    gpus = (
        subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
        if shutil.which("nvidia-smi")
        else None
    )
    if gpus is None or gpus.returncode != 0 or "GPU" not in gpus.stdout:
        return record("serving", "vllm_tiny", host, None, reason="no CUDA GPU on this host (nvidia-smi -L)")
    if not Path(config).is_file():
        raise QualifyError(f"--config {config}: no such file")
    try:
        r = subprocess.run(
            ["bash", script],
            env={**os.environ, "REAL_CONFIG": config},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return record(
            "serving", "vllm_tiny", host, False, None, "exit 0", reason=f"{script} ran past {timeout_s:.0f} s"
        )
    tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-8:]
    return record(
        "serving",
        "vllm_tiny",
        host,
        r.returncode == 0,
        tail,
        "exit 0, identical greedy text: True",
        reason="" if r.returncode == 0 else f"{script} exit {r.returncode}: {tail[-1] if tail else ''}",
    )
