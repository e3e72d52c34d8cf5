"""The ``vllm.general_plugins`` entry point of the dsv41 package (``dsv41_overlay``).

vLLM calls :func:`register` in its API, engine-core and worker processes when ``VLLM_PLUGINS``
names ``dsv41_overlay`` (or is unset).  ``register`` imports no torch and no vLLM module:

* nothing configured (no ``DSV41_ENGRAM_REMOTE``, no ``DSV41_DRAFTER_REMOTE``): returns, inert;
* a bad setting: raises ConfigError, which stops vLLM (vLLM runs ``register`` outside its
  loader's try block, a fact the contract records);
* the installed vLLM differs from ``vllm_contract.json`` (version, sha256 of a patched or
  relied-on file): raises ContractMismatch in required mode, otherwise logs one line and stays
  inert (vLLM's own Engram tables and drafter);
* otherwise installs post-import hooks that patch vLLM's Engram and speculator modules when (and
  only if) the process imports them (:mod:`dsv41.overlay.hooks`).

In every case but a raise, with ``DSV41_OVERLAY_METRICS_ADDR`` set, the process that imports
vLLM's GPU model runner (the worker: one per rank) serves the rank's metrics and state
(:mod:`dsv41.overlay.metrics`), so an inert or refused overlay is visible to the checks.

vLLM configures only its ``vllm`` logger; without a handler on ``dsv41`` (or the root) the
overlay's INFO lines ("dsv41 overlay active", which the serving checks look for) would be
dropped, so ``register`` attaches one stderr handler to ``dsv41`` when none is configured
(:func:`ensure_log_handler`).
"""

from __future__ import annotations

import logging
import sys

from dsv41.overlay import contract as C, settings as S

log = logging.getLogger("dsv41.overlay")
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"

#: Set by :func:`register`: "inert", "contract-mismatch" or "active".
STATE = {"state": "unregistered", "problems": []}


def register() -> None:
    """vLLM's general-plugin hook; see the module docstring.  Safe to call more than once."""
    ensure_log_handler()
    settings = S.parse()
    if not settings.active:
        STATE.update(state="inert", problems=[])
        _serve_metrics(settings, "inert")
        return
    contract = C.load()
    root = C.installed_vllm_root()
    problems = ["vLLM is not installed"] if root is None else C.check_files(contract, root, C.installed_version())
    if problems:
        STATE.update(state="contract-mismatch", problems=problems)
        msg = (
            f"dsv41 overlay: the installed vLLM is not the one in vllm_contract.json "
            f"({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})"
        )
        if settings.engram and settings.required:
            raise C.ContractMismatch(msg + "; refusing to start because DSV41_ENGRAM_REMOTE_REQUIRED=1")
        log.error("%s; overlay inert: vLLM's own Engram tables and drafter are used", msg)
        _serve_metrics(settings, "contract-mismatch", problems[0])
        return
    from dsv41.overlay import hooks

    hooks.install(settings, contract)
    STATE.update(state="active", problems=[])
    _serve_metrics(settings, "active")
    log.info(
        "dsv41 overlay active (vLLM %s): engram %s, drafter %s",
        contract["vllm_version"],
        "remote" if settings.engram else "vLLM's own",
        "remote" if settings.drafter else "vLLM's own",
    )


def ensure_log_handler() -> logging.Handler | None:
    """Attach one stderr handler (level INFO, :data:`LOG_FORMAT`) to the ``dsv41`` logger when
    neither it nor the root logger has a handler (inside ``vllm serve``, which configures only
    ``vllm``); returns the handler attached, or None when one was already configured.  The
    logger's level is set to INFO only when it had none, and it still propagates."""
    logger = logging.getLogger("dsv41")
    if logger.handlers or logging.getLogger().handlers:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return handler


def _serve_metrics(settings: S.OverlaySettings, state: str, why: str = "") -> None:
    """Record ``state`` and, when ``DSV41_OVERLAY_METRICS_ADDR`` is set, start the rank's endpoint
    once vLLM's GPU model runner is imported (the worker only: never twice per host)."""
    from dsv41.overlay import hooks, metrics as M

    M.set_state(state, settings.env.overlay_rank, why)
    addr = settings.env.overlay_metrics_addr.strip()
    if addr:
        from dsv41.engram.server import parse_hostport

        parse_hostport(addr, "DSV41_OVERLAY_METRICS_ADDR")  # a bad address stops vLLM here, not in the worker
        hooks.on_import(hooks.MODEL_RUNNER_MODULE, lambda _module: M.start(addr, settings.env))
