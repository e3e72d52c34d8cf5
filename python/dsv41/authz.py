"""Who may change a serving endpoint: the operator credential, the cross-site guard, the API key.

One definition for both servers that take admission commands, the lab engine
(``dsv41.engine.server``) and the vLLM admission fence (``dsv41.overlay.fence``), and for the
project's clients (``dsv41.harness.http``). Standard library only (the fence runs inside vLLM's API
server process).

- **Operator credential**: a random secret (:func:`new_secret`) the deploy generates on the
  controller and installs, mode 0600, on rank 0's host; servers and clients read it from the file
  named by ``DSV41_OPERATOR_CREDENTIAL_FILE`` (:func:`load_secret`), never from a command line.
  Requests send it in :data:`OPERATOR_HEADER`; it is compared in constant time.
- **Control requests** (:func:`is_control`): every request that is not a read (``GET``, ``HEAD``,
  ``OPTIONS``) and not an inference route (:func:`is_inference`): ``/pause``, ``/resume`` and any
  route a server adds later (vLLM's dev routes included) without a change here. Such a request is
  refused (:func:`control_refusal`) unless it carries the credential and does not have a browser's
  cross-site shape: an ``Origin`` that is not the ``Host``, ``Sec-Fetch-Site`` other than
  ``same-origin``/``none``, a ``Host`` that is neither an IP literal, ``localhost`` nor one of
  ``DSV41_CONTROL_HOSTS`` (DNS rebinding), or a body that is not ``application/json``.
- **API key** (vLLM's convention, ``--api-key`` / ``VLLM_API_KEY``): when a server has one,
  every ``/v1`` route wants ``Authorization: Bearer KEY`` (:func:`api_key_refusal`); clients read
  it from ``DSV41_API_KEY_FILE``.

Refusals are ``(status, message)`` pairs the servers answer in OpenAI's error shape: 401 without
a valid credential or key, 403 for a cross-site shape or a server that has no credential (it
refuses every control request: fail closed).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

from dsv41.errors import Dsv41Error

#: Header carrying the operator credential (ASGI spelling: lower case).
OPERATOR_HEADER = "x-dsv41-operator"
#: Bytes of randomness in a secret (:func:`new_secret`): 256 bits.
SECRET_BYTES = 32
#: Longest secret file read (bytes).
MAX_SECRET_BYTES = 4096
#: Methods that never change state (RFC 9110 safe methods).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Routes outside ``/v1`` that serve inference (vLLM's), not control.
INFERENCE_PATHS = frozenset({"/invocations", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank"})


class CredentialError(Dsv41Error):
    """A secret file that is missing, unreadable, readable by others, or empty."""


def new_secret() -> str:
    """A fresh random secret: ``secrets.token_urlsafe(SECRET_BYTES)`` (43 characters of
    ``[A-Za-z0-9_-]``); also a valid window token (``engine.hold.WINDOW_TOKEN_RE``)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def load_secret(path: str | os.PathLike, what: str = "operator credential") -> str:
    """The secret kept in ``path`` (surrounding whitespace stripped).

    Raises CredentialError (one line naming the file, never the secret) when the file cannot be
    read, is not a regular file, is readable or writable by group or others (mode must be 0600 or
    stricter), is over :data:`MAX_SECRET_BYTES`, or holds no secret of at least 16 printable ASCII
    characters without spaces."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CredentialError(f"{what} file {p}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CredentialError(f"{what} file {p} is not a regular file")
        if st.st_mode & 0o077:
            raise CredentialError(
                f"{what} file {p} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0600 (readable by its owner only)"
            )
        raw = os.read(fd, MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise CredentialError(f"{what} file {p}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_SECRET_BYTES:
        raise CredentialError(f"{what} file {p} is over {MAX_SECRET_BYTES} bytes")
    text = raw.decode("ascii", errors="replace").strip()
    if len(text) < 16 or not all(33 <= ord(c) < 127 for c in text):
        raise CredentialError(f"{what} file {p} holds no secret (at least 16 printable characters, no spaces)")
    return text


def write_secret(path: str | os.PathLike, secret: str) -> None:
    """Write ``secret`` to ``path`` created with mode 0600 (an existing file is replaced
    atomically through a 0600 temporary beside it). Raises CredentialError."""
    p = os.fspath(path)
    tmp = f"{p}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (secret + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CredentialError(f"cannot write {p}: {exc.strerror or exc}") from None


def same_secret(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison (``hmac.compare_digest``); False when either is empty/None."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("utf-8", "replace"))


def is_inference(path: str) -> bool:
    """True for the OpenAI API's routes (``/v1/...``) and vLLM's other inference routes. A path
    with a dot segment (``.`` or ``..``, percent-encoded or not) is never inference: anything
    behind the fence that collapsed it (``/v1/../pause``) would reach a control route."""
    if any(seg in (".", "..") for seg in unquote(path).split("/")):
        return False
    return path.startswith("/v1/") or path == "/v1" or path in INFERENCE_PATHS


def is_control(method: str, path: str) -> bool:
    """True when a request may change the server's state and is not inference: any method but
    GET/HEAD/OPTIONS on a path :func:`is_inference` does not claim."""
    return method.upper() not in SAFE_METHODS and not is_inference(path)


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, v in raw:
        out.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))
    return out


def _host_name(host: str) -> str:
    """The name part of a Host header value (port and IPv6 brackets removed), lower case."""
    h = host.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def host_allowed(host: str, allowed: Iterable[str] = ()) -> bool:
    """True when ``host`` (a Host header) names an IP literal, ``localhost`` or one of ``allowed``."""
    name = _host_name(host)
    if not name:
        return False
    if name == "localhost" or name in {a.strip().lower() for a in allowed if a.strip()}:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def control_refusal(
    raw_headers: Iterable[tuple[bytes, bytes]], credential: str | None, allowed_hosts: Iterable[str] = ()
) -> tuple[int, str] | None:
    """Why a control request with these ASGI headers is refused, or None when it may go on.

    ``credential``: the server's operator credential (None or empty: every control request is
    refused, 403). Checked in this order: the server has a credential; no cross-site shape
    (foreign ``Origin``, cross-site ``Sec-Fetch-Site``, Host not allowed, a body that is not
    JSON); the :data:`OPERATOR_HEADER` equals the credential (401)."""
    h = _headers(raw_headers)
    if not credential:
        return 403, "this server has no operator credential (DSV41_OPERATOR_CREDENTIAL_FILE): control routes are closed"
    host = (h.get("host") or [""])[0]
    if not host_allowed(host, allowed_hosts):
        return 403, f"control requests must name this server by address, localhost or DSV41_CONTROL_HOSTS, not {host!r}"
    for origin in h.get("origin", []):
        o = urlsplit(origin)
        if origin == "null" or o.netloc.lower() != host.strip().lower():
            return 403, "cross-origin control requests are refused (Origin is not this server)"
    if any(v.strip().lower() not in ("same-origin", "none") for v in h.get("sec-fetch-site", [])):
        return 403, "cross-site control requests are refused (Sec-Fetch-Site)"
    ctype = (h.get("content-type") or [""])[0].split(";")[0].strip().lower()
    has_body = any(v.strip() not in ("", "0") for v in h.get("content-length", [])) or "transfer-encoding" in h
    if (ctype or has_body) and ctype != "application/json":
        return 403, f"control requests take no body or a JSON one, not {ctype or 'an untyped body'!r}"
    given = h.get(OPERATOR_HEADER, [])
    if len(given) != 1 or not same_secret(given[0], credential):
        return 401, f"a valid operator credential ({OPERATOR_HEADER.title()} header) is required"
    return None


def api_key_refusal(
    method: str, path: str, raw_headers: Iterable[tuple[bytes, bytes]], api_key: str | None
) -> tuple[int, str] | None:
    """vLLM's ``--api-key`` rule: with a key set, every ``/v1`` request except ``OPTIONS`` needs
    ``Authorization: Bearer KEY`` (401 otherwise); None when it may go on."""
    if not api_key or method.upper() == "OPTIONS" or not path.startswith("/v1"):
        return None
    auth = _headers(raw_headers).get("authorization", [])
    if len(auth) == 1 and auth[0][:7].lower() == "bearer " and same_secret(auth[0][7:].strip(), api_key):
        return None
    return 401, "a valid API key (Authorization: Bearer KEY) is required"


def server_settings(settings=None, api_key_env: str | None = None) -> tuple[str | None, tuple[str, ...]]:
    """The operator credential a server enforces and its allowed control host names, from
    ``DSV41_OPERATOR_CREDENTIAL_FILE`` and ``DSV41_CONTROL_HOSTS`` (``settings``: a parsed
    ``dsv41.envs.Settings``; default: this process's environment). ``(None, hosts)`` when no
    file is named. Raises CredentialError for a named file that cannot be used."""
    from dsv41 import envs

    s = settings if settings is not None else envs.parse()
    hosts = tuple(x.strip() for x in s.control_hosts.split(",") if x.strip())
    if not s.operator_credential_file:
        return None, hosts
    return load_secret(s.operator_credential_file), hosts


def client_headers(operator: bool, settings=None) -> dict[str, str]:
    """The headers a project client adds: ``Authorization: Bearer KEY`` when
    ``DSV41_API_KEY_FILE`` names a key, and the :data:`OPERATOR_HEADER` when ``operator`` and
    ``DSV41_OPERATOR_CREDENTIAL_FILE`` names a credential. Raises CredentialError."""
    from dsv41 import envs

    s = settings if settings is not None else envs.parse()
    out: dict[str, str] = {}
    if s.api_key_file:
        out["Authorization"] = "Bearer " + load_secret(s.api_key_file, "API key")
    if operator and s.operator_credential_file:
        out["X-DSV41-Operator"] = load_secret(s.operator_credential_file)
    return out
