"""Build the speculator that the settings ask for (docs/interfaces.md, drafter section).

Input is :class:`dsv41.envs.Settings` (the environment is parsed once, in :mod:`dsv41.envs`);
this module adds the checks that need the drafter package: the worker URL, the depth policy, the
drafter files against the target model, and the identities a worker must present.
"""

from __future__ import annotations

import logging

from dsv41.drafter import protocol as P
from dsv41.drafter.async_speculator import AsyncSpeculator
from dsv41.drafter.policy import DepthPolicy
from dsv41.drafter.speculators import LocalSpeculator, RemoteSpeculator, ShadowSpeculator
from dsv41.envs import ConfigError, Settings
from dsv41.errors import ConfigError as ModelConfigError, Dsv41Error

log = logging.getLogger("dsv41.drafter.factory")


def expected_identities(drafter_dir: str, target_identity: str) -> dict:
    """Identities the Spark side requires of a worker: drafter and Markov head from the drafter
    files in ``drafter_dir``, target = the engine's own ``target_identity``.

    Raises :class:`dsv41.errors.ConfigError` when the files are missing, and
    :class:`dsv41.envs.ConfigError` (naming ``DSV41_DRAFTER_DIR``) when they were distilled for
    another target.
    """
    from dsv41.drafter.model import identities

    ids = identities(drafter_dir)
    if ids["target"] and target_identity and ids["target"] != target_identity:
        raise ConfigError(
            "DSV41_DRAFTER_DIR",
            f"DSV41_DRAFTER_DIR {drafter_dir}: drafter was distilled for target {ids['target'][:12]}, "
            f"the engine serves {target_identity[:12]}",
        )
    return {"drafter": ids["drafter"], "markov": ids["markov"], "target": target_identity or ids["target"]}


def check_model(drafter_dir: str, model_cfg: dict) -> None:
    """The drafter in ``drafter_dir`` fits the target: same ``hidden_size``, ``vocab_size`` and
    tap layer (``drafter_tap_layer``) as ``model_cfg`` (the target's config dict; absent keys are
    not checked). Raises :class:`dsv41.errors.ConfigError` naming the first difference."""
    from dsv41.drafter.model import load_config

    cfg = load_config(drafter_dir)
    for key, mine in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        theirs = model_cfg.get(key)
        if theirs is not None and int(theirs) != mine:
            raise ModelConfigError(f"drafter {drafter_dir}: {key} {mine} != target model's {theirs}")
    tap = model_cfg.get("drafter_tap_layer")
    if tap is not None and int(tap) != cfg.tap_layer:
        raise ModelConfigError(f"drafter {drafter_dir}: tap layer {cfg.tap_layer} != target's drafter_tap_layer {tap}")


def build_speculator(settings: Settings, *, model_cfg: dict, target_identity: str, device: str = "cpu"):
    """The speculator ``settings`` ask for, or None when speculation is off.

    ``drafter_remote`` (tcp URL) -> :class:`RemoteSpeculator` (``drafter_async``:
    :class:`AsyncSpeculator` via the proxy; ``drafter_shadow``: :class:`ShadowSpeculator`), with
    identities from ``drafter_dir``; ``drafter_local`` (drafter dir) -> :class:`LocalSpeculator`;
    neither -> None. ``model_cfg``: the target's config dict; ``target_identity``: its sha256.
    Raises :class:`dsv41.errors.ConfigError` (a :class:`dsv41.envs.ConfigError` when one
    variable is at fault) on a bad URL, depth policy or drafter files.
    """
    s = settings
    if not s.drafter_remote and not s.drafter_local:
        return None
    k = s.drafter_k
    try:
        policy = DepthPolicy.parse(s.drafter_depth_policy or None, k)
    except ModelConfigError as exc:
        raise ConfigError("DSV41_DRAFTER_DEPTH_POLICY", str(exc)) from None
    log.info("drafter depth policy: %s", policy)
    if s.drafter_local:
        check_model(s.drafter_local, model_cfg)
        ids = expected_identities(s.drafter_local, target_identity)
        log.info("local drafter %s (drafter %s, markov %s)", s.drafter_local, ids["drafter"][:12], ids["markov"][:12])
        return LocalSpeculator(s.drafter_local, k=k, policy=policy, device=device)
    try:
        P.parse_url(s.drafter_remote)
    except Dsv41Error as exc:
        raise ConfigError("DSV41_DRAFTER_REMOTE", str(exc)) from None
    check_model(s.drafter_dir, model_cfg)
    expected = expected_identities(s.drafter_dir, target_identity)
    if s.drafter_async:
        from dsv41.drafter.model import load_config

        cfg = load_config(s.drafter_dir)
        spec = AsyncSpeculator(
            s.drafter_remote,
            expected,
            k=k,
            policy=policy,
            timeout_ms=s.drafter_timeout_ms,
            watchdog_ms=s.drafter_watchdog_ms,
            respawns=s.drafter_proxy_respawns,
            window_s=s.drafter_proxy_window_s,
            memlock=s.drafter_proxy_memlock,
            max_context=cfg.n_ctx,
            max_k=cfg.max_k,
        )
        # At engine start-up give the proxy a moment to connect (never required: fail closed).
        if not spec.wait_ready(10.0):
            log.warning(
                "drafter proxy not connected to %s after 10 s (%s); drafting target-only until it is",
                s.drafter_remote,
                spec.ring.error if spec.ring is not None else "proxy down",
            )
        return spec
    if s.drafter_shadow:
        return ShadowSpeculator(
            s.drafter_remote, expected, s.drafter_dir, k=k, policy=policy, timeout_ms=s.drafter_timeout_ms
        )
    return RemoteSpeculator(s.drafter_remote, expected, k=k, policy=policy, timeout_ms=s.drafter_timeout_ms)


def kv_budget_extra_tokens(settings: Settings) -> int:
    """Extra KV-cache tokens the engine may allocate because the drafter runs remotely.

    Capacity mode (``drafter_capacity_mode``) with a remote drafter returns
    ``drafter_local_memory_tokens`` (the KV tokens the local drafter's memory would hold);
    otherwise 0. The combinations that make no sense are refused by :func:`dsv41.envs.parse`.
    The engine adds the result to its KV budget and reports it.
    """
    if not settings.drafter_capacity_mode or not settings.drafter_remote:
        return 0
    return settings.drafter_local_memory_tokens
