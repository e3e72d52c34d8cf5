"""Is the pinned serving image in this host's dockerd, with exactly the pinned ID or digest?

roles/serve runs ``dsv41 env image`` on each Spark before anything stops the running engine:
a unit whose ``docker run`` names an image the host does not have would leave the TP
pair down, and ``docker run --pull never`` (or an air-gapped site) cannot fetch it. A pin is one of

- an image ID, ``sha256:<64 hex>`` (the lab: the ID of the image the lab built and loaded);
- a repo digest, ``REPO@sha256:<64 hex>`` (production: what a registry serves for that digest).

A tag (``vllm/vllm-openai:latest``) is not a pin and is refused. The image is present only when an
image's full ``Id`` equals the ID, or its ``RepoDigests`` holds the digest; docker's own lookup
would accept an ID prefix or resolve a tag, so the comparison is done here over every image the
daemon lists (``docker image inspect`` of ``docker image ls -q --no-trunc``). When it is absent,
the error names the host, the pin and what the host has under the pin's repository (or
``repository``): their IDs and digests. Formats: docker image inspect(1), the Engine API's
ImageInspect (``Id``, ``RepoTags``, ``RepoDigests``).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

from dsv41 import fileio
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

_HEX64 = r"[0-9a-f]{64}"
PIN_ID = re.compile(rf"^sha256:{_HEX64}$")
PIN_DIGEST = re.compile(rf"^(?P<repo>[a-z0-9][a-z0-9._/:-]*[a-z0-9])@(?P<digest>sha256:{_HEX64})$")
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Pin:
    """A parsed pin: ``kind`` is ``id`` or ``digest``; ``repo`` the repository (``""`` for an ID)."""

    value: str
    kind: str
    repo: str


def parse_pin(pin: str) -> Pin:
    """Parse ``pin`` (str). Raises :class:`ConfigError` for an empty value, a tag or anything that
    is neither ``sha256:<64 hex>`` nor ``REPO@sha256:<64 hex>``."""
    pin = pin.strip()
    if PIN_ID.match(pin):
        return Pin(pin, "id", "")
    m = PIN_DIGEST.match(pin)
    if m:
        return Pin(pin, "digest", m.group("repo"))
    if not pin:
        raise ConfigError("serve_image is empty: pin the serving image by repo digest or image ID")
    raise ConfigError(f"serve_image {pin!r} is not pinned: give REPO@sha256:<64 hex> or an image ID sha256:<64 hex>")


def _repo_of(ref: str) -> str:
    """``REPO`` of ``REPO:TAG`` or ``REPO@DIGEST`` (a registry port's colon is kept)."""
    if "@" in ref:
        return ref.split("@", 1)[0]
    head, _, tail = ref.rpartition(":")
    return head if head and "/" not in tail else ref


def find(pin: Pin, images: list[dict]) -> dict | None:
    """The image of ``images`` (docker image inspect objects) that is exactly ``pin``, or None."""
    for image in images:
        if pin.kind == "id" and image.get("Id") == pin.value:
            return image
        if pin.kind == "digest" and pin.value in (image.get("RepoDigests") or []):
            return image
    return None


def describe_found(pin: Pin, images: list[dict], repository: str = "") -> str:
    """What the host has instead of ``pin``: every image under the pin's repository (or
    ``repository``) as ``NAME = ID`` with its digests, else how many images it has in all."""
    repo = pin.repo or repository
    named = []
    for image in images:
        refs = [r for r in (image.get("RepoTags") or []) + (image.get("RepoDigests") or []) if _repo_of(r) == repo]
        if refs:
            named.append(f"{' '.join(sorted(set(refs)))} = {image.get('Id', '?')}")
    if named:
        return "; ".join(sorted(named))
    where = f"no image of {repo}" if repo else "no image with that ID"
    return f"{where} ({len(images)} image(s) in all)"


def check(pin_text: str, images: list[dict], host: str, repository: str = "") -> dict:
    """Decide for one host. ``images``: docker image inspect objects (``Id``, ``RepoTags``,
    ``RepoDigests``). Returns ``{"host", "image", "id", "ok": True}``. Raises
    :class:`ConfigError` for a pin that is not a pin and :class:`VerificationError`, in one line
    naming ``host``, the pin and what was found, when the image is absent."""
    pin = parse_pin(pin_text)
    image = find(pin, images)
    if image is None:
        raise VerificationError(
            f"{host}: the serving image {pin.value} is not in dockerd; found: "
            f"{describe_found(pin, images, repository)}; nothing was stopped"
        )
    return {"host": host, "image": pin.value, "id": image.get("Id"), "ok": True}


def list_images(docker: str) -> list[dict]:
    """Every image in the daemon ``docker`` (the CLI path) talks to, as inspect objects. Raises
    :class:`Dsv41Error` (one line) when the CLI is missing, the daemon does not answer within
    ``TIMEOUT_S`` or its output is not the JSON list docker documents."""

    def run(argv: list[str]) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except FileNotFoundError:
            raise Dsv41Error(f"{docker} not found (the container runtime, serve_container_runtime)") from None
        except subprocess.TimeoutExpired:
            raise Dsv41Error(f"{' '.join(argv[:3])}: dockerd did not answer in {TIMEOUT_S:g} s") from None
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise Dsv41Error(f"{' '.join(argv[:3])}: {last}")
        return r.stdout

    ids = sorted(set(run([docker, "image", "ls", "-q", "--no-trunc"]).split()))
    if not ids:
        return []
    out = run([docker, "image", "inspect", *ids])
    try:
        images = fileio.loads_json(out)
    except json.JSONDecodeError as exc:
        raise Dsv41Error(f"{docker} image inspect: not JSON ({exc.msg})") from None
    if not isinstance(images, list) or not all(isinstance(i, dict) for i in images):
        raise Dsv41Error(f"{docker} image inspect: not a list of images")
    return images
