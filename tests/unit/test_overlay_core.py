"""The overlay's C++ worker core is optional (``dsv41.overlay.core``): where ``dsv41.overlay._core``
is not built, or the transport is forced to pure Python, every gate that would use it (the
worker's core, the table's slot, the id plan, the GPU join) says no and the Python worker serves
exact rows; where it is built and the C++ transport is in use, they say yes."""

from __future__ import annotations

import pytest
import torch

from dsv41.overlay import core, engram as E, engram_gpujoin as GJ, engram_ops as O, engram_worker as EW
from dsv41.transport import native
from overlayutil import Gate, exact_rows, lookup_ids, poisoned, remote_rows, tabs  # noqa: F401 - tabs is a fixture


@pytest.fixture
def workers():
    yield
    E.stop_workers()


def _gates() -> dict:
    return {
        "use_core": core.use_core(),
        "implementation": core.implementation(),
        "worker_core": EW._new_core(64) is not None,
        "plan": O._native_plan() is not None,
        "gpu_join": GJ.available(0),
    }


def _one_step(tabs_) -> tuple[bool, bool]:
    """One step of layer 1 through the Python worker: (rows exact, the table got a C++ slot)."""
    rr = remote_rows(tabs_, Gate(tabs_), 1)
    ids = lookup_ids(tabs_, rr, 24, 3)
    out = poisoned(24, rr.part)
    rr.start(torch.from_numpy(ids), out)
    rr.join()
    return exact_rows(tabs_, rr, ids, out), rr._slot is not None


@pytest.mark.parametrize("absent", ["core", "transport", "pure"])
def test_without_the_core_every_gate_says_no_and_python_serves_exact_rows(tabs, workers, monkeypatch, absent):
    if absent == "core":
        monkeypatch.setattr(core, "_core", None)  # an image without dsv41.overlay._core
    elif absent == "transport":
        monkeypatch.setattr(native, "_fastrow", None)  # the core needs the C++ transport's connection
    else:
        monkeypatch.setenv("DSV41_TRANSPORT_PURE", "1")
    assert _gates() == {
        "use_core": False,
        "implementation": "python",
        "worker_core": False,
        "plan": False,
        "gpu_join": False,
    }
    assert _one_step(tabs) == (True, False)


@pytest.mark.skipif(core._core is None or native._fastrow is None, reason="the C++ extensions are not built")
def test_with_both_extensions_the_core_is_used(tabs, workers, monkeypatch):
    monkeypatch.delenv("DSV41_TRANSPORT_PURE", raising=False)
    g = _gates()
    assert g["use_core"] and g["implementation"] == "c++" and g["worker_core"] and g["plan"]
    assert _one_step(tabs) == (True, True)
