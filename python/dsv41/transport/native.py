"""Which implementation of the transport hot path is in use.

The C++ extension ``dsv41.transport._fastrow`` (built by ``pip install -e .`` via setup.py) is
used when importable; ``DSV41_TRANSPORT_PURE=1`` forces the pure-Python path.  Both paths are
tested to produce identical bytes and statuses (tests/unit/test_transport_tcp.py).
"""

from __future__ import annotations

from dsv41 import envs

try:
    from dsv41.transport import _fastrow  # type: ignore[attr-defined]
except ImportError:  # not built on this host: pure Python still serves exact rows
    _fastrow = None


def use_native(requested: bool | None = None) -> bool:
    """True when the C++ path should be used (``requested`` overrides the environment).

    Raises ``dsv41.envs.ConfigError`` on a bad environment, ``RuntimeError`` when ``requested`` is True but the extension is not built.
    """
    if requested is None:
        return _fastrow is not None and not envs.parse().transport_pure
    if requested and _fastrow is None:
        raise RuntimeError("the C++ transport extension is not built (run pip install -e .)")
    return bool(requested)


def implementation() -> str:
    """``"c++"`` or ``"python"``: the path a default-constructed client/server uses."""
    return "c++" if use_native() else "python"
