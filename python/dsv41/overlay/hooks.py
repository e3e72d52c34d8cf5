"""Post-import hooks: patch a vLLM module right after the process imports it (or at once when
it already has).  Nothing is imported here: a process that never builds the model (vLLM's API
server) never loads vLLM's Engram or speculator modules because of the overlay.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("dsv41.overlay")

ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
SPEC_INIT_MODULE = "vllm.v1.worker.gpu.spec_decode"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

_lock = threading.RLock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def _run(module: ModuleType) -> None:
    with _lock:
        patches = _pending.pop(module.__name__, [])
    for patch in patches:
        patch(module)


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the module's patches."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _run(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds specs for the hooked names through the other finders and wraps their loaders."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_finder = _Finder()


def on_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Run ``patch(module)`` once ``name`` is imported: now when it already is."""
    with _lock:
        _pending.setdefault(name, []).append(patch)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        _run(module)


def install(settings: Any, contract: dict) -> None:
    """Hook the patches ``settings`` asks for (Engram rows, drafter)."""
    if settings.engram:

        def engram(module: ModuleType) -> None:
            from dsv41.overlay import engram as E

            E.apply(module, settings, contract)

        on_import(ENGRAM_MODULE, engram)
    if settings.drafter:

        def spec_init(module: ModuleType) -> None:
            from dsv41.overlay import drafter as D

            D.apply_init_speculator(module, settings)

        on_import(SPEC_INIT_MODULE, spec_init)
        on_import(MODEL_RUNNER_MODULE, spec_init)
