"""Pair safety of the two-card drafter worker: the facts of each device, the checks made before
anything is loaded, and the card names the lifetime locks use.

:func:`probe_device` reads a device's facts (:class:`DeviceFacts`), :func:`probe_peer` whether two
CUDA cards reach each other's memory directly, and :func:`check_pair` refuses a pair that cannot
serve identically (a card missing, one card named twice, cards of different kinds, names, memory
sizes, compute capabilities or drivers: the two ranks must run the same kernels, since each picks
the draft tokens itself from the gathered logits) and returns the warnings of a pair that can
(no peer access: NCCL then routes the collectives through host memory, slower, never wrong).
The checks take the facts as data, so they are tested on CPU with injected facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv41.errors import Dsv41Error

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class DeviceFacts:
    """What the checks compare about one device.

    ``device``: as given (``cpu``, ``cuda:N``); ``present``: the device exists in this process;
    ``name``: the product name (``cpu`` for the CPU); ``uuid``: the CUDA card's UUID ("" for CPU);
    ``total_memory``: bytes (0 for CPU); ``capability``: ``"8.6"`` ("" for CPU); ``driver``: the
    CUDA driver version the process uses ("" for CPU); ``visible``: CUDA devices visible (0 for CPU).
    """

    device: str
    present: bool
    name: str = ""
    uuid: str = ""
    total_memory: int = 0
    capability: str = ""
    driver: str = ""
    visible: int = 0

    @property
    def kind(self) -> str:
        """``cpu`` or ``cuda``."""
        return self.device.split(":", 1)[0]

    def describe(self) -> str:
        """One phrase for error lines: ``cuda:1 (NVIDIA GeForce RTX 3090, 24.0 GiB, sm 8.6, driver 12040)``."""
        if self.kind == "cpu":
            return self.device
        return (
            f"{self.device} ({self.name}, {self.total_memory / 2**30:.1f} GiB, sm {self.capability}, "
            f"driver {self.driver or '?'})"
        )


def parse_devices(text: str, count: int) -> list[str]:
    """``"cuda:0,cuda:1"`` -> the list; :class:`Dsv41Error` unless it names exactly ``count``
    devices, each ``cpu``, ``cuda`` or ``cuda:N`` (``cuda`` means ``cuda:0``)."""
    items = [t.strip() for t in text.split(",")] if text.strip() else []
    if len(items) != count or not all(DEVICE.fullmatch(t) for t in items):
        raise Dsv41Error(
            f"drafter serve: --devices {text!r}: expected {count} devices separated by commas, each cpu, "
            "cuda or cuda:N (e.g. cuda:0,cuda:1)"
        )
    return ["cuda:0" if t == "cuda" else t for t in items]


def probe_device(device: str) -> DeviceFacts:
    """The facts of ``device`` as this process sees it (imports torch)."""
    import torch

    if device == "cpu":
        return DeviceFacts(device, True, name="cpu")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= visible:
        return DeviceFacts(device, False, visible=visible)
    props = torch.cuda.get_device_properties(index)
    get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # no public accessor in torch
    return DeviceFacts(
        device,
        True,
        name=str(props.name),
        uuid=str(getattr(props, "uuid", "") or ""),
        total_memory=int(props.total_memory),
        capability=f"{props.major}.{props.minor}",
        driver=str(get_driver()) if get_driver else "",
        visible=visible,
    )


def probe_peer(a: str, b: str) -> bool | None:
    """Whether CUDA cards ``a`` and ``b`` can each access the other's memory (None for CPU)."""
    if not (a.startswith("cuda") and b.startswith("cuda")):
        return None
    import torch

    ia, ib = (int(d.split(":", 1)[1]) if ":" in d else 0 for d in (a, b))
    return bool(torch.cuda.can_device_access_peer(ia, ib) and torch.cuda.can_device_access_peer(ib, ia))


def check_pair(facts: list[DeviceFacts], peer: bool | None) -> list[str]:
    """Refuse an unsafe pair (:class:`Dsv41Error`, one line naming both devices); return warning
    lines for a safe one (no direct peer access between CUDA cards: the fallback is named).

    Two CPU devices are allowed (the CPU stands in for both cards: tests and the lab); two CUDA
    devices must be two different cards (UUID, or index when no UUID is known) of one identity.
    """
    if len(facts) != 2:
        raise Dsv41Error(f"drafter pair: {len(facts)} devices given; the two-card worker needs exactly 2")
    a, b = facts
    for f in facts:
        if not f.present:
            raise Dsv41Error(
                f"drafter pair: device {f.device} is not present ({f.visible} CUDA device(s) visible to this "
                "process); check CUDA_VISIBLE_DEVICES and the driver"
            )
    if a.kind != b.kind:
        raise Dsv41Error(f"drafter pair: {a.device} and {b.device} are different kinds of device; use two cards")
    if a.kind == "cpu":
        return []
    same = (a.uuid and a.uuid == b.uuid) or (not (a.uuid and b.uuid) and a.device == b.device)
    if same:
        raise Dsv41Error(f"drafter pair: {a.device} and {b.device} are the same card; name two different cards")
    for field, label in (
        ("name", "product"),
        ("total_memory", "memory size"),
        ("capability", "compute capability"),
        ("driver", "driver"),
    ):
        if getattr(a, field) != getattr(b, field):
            raise Dsv41Error(
                f"drafter pair: {a.describe()} and {b.describe()} differ in {label}; both ranks pick draft "
                "tokens themselves and must run identical kernels, so the pair must be two identical cards"
            )
    if peer is False:
        return [
            f"drafter pair: no peer access between {a.device} and {b.device} (no NVLink or P2P path): NCCL falls "
            "back to copies through host memory, so rounds are slower but the drafts the same; check "
            "`nvidia-smi topo -m`"
        ]
    return []


def card_key(facts: DeviceFacts, position: int) -> str:
    """The lock name of a pair's card: ``gpu-<uuid>`` (``gpu-index-N`` without a UUID) for CUDA,
    ``cpu-<position>`` for a CPU stand-in (position 0 or 1 in ``--devices``)."""
    if facts.kind == "cpu":
        return f"cpu-{position}"
    if facts.uuid:
        return "gpu-" + re.sub(r"[^A-Za-z0-9-]", "", facts.uuid.removeprefix("GPU-"))[:64]
    return f"gpu-index-{facts.device.split(':', 1)[1] if ':' in facts.device else '0'}"
