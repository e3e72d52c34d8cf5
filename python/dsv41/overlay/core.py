"""Which worker core the overlay's Engram layer runs: the C++ extension or Python.

The C++ extension ``dsv41.overlay._core`` (``_core.cpp`` and its ``core_*.h`` headers, built by
``pip install -e .`` via setup.py next to the transport's ``dsv41.transport._fastrow``) holds the
worker core (``EngramCore``, ``EngramSlot``), the id plan (``plan_rows``, ``plan_pieces``) and the
GPU join's driver probe and watchdog (``stream_mem_ops``, ``gj_watch_start``). It is used when it
imports and the C++ transport is in use (``dsv41.transport.native.use_native``: the core sends
its requests on a connection the C++ client lends it, and ``DSV41_TRANSPORT_PURE=1`` forces
Python for both). Where it is not built the overlay runs its Python worker and numpy plan, which
the tests hold to the same rows.
"""

from __future__ import annotations

from dsv41.transport import native

try:
    from dsv41.overlay import _core  # type: ignore[attr-defined]
except ImportError:  # not built on this host: the Python worker still serves exact rows
    _core = None


def use_core() -> bool:
    """True when the C++ worker core should be used: the extension imports and
    ``dsv41.transport.native.use_native()`` holds (raises ``dsv41.envs.ConfigError`` on a bad
    environment, as that does)."""
    return _core is not None and native.use_native()


def implementation() -> str:
    """``"c++"`` or ``"python"``: the worker core a new Engram layer gets."""
    return "c++" if use_core() else "python"
