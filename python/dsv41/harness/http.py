"""The harness's one HTTP client (httpx): timeouts, no proxy variables, one clear error line.

Every harness call to a serving endpoint (admission, greedy references, ``/metrics``) goes through
:func:`request`, so a timeout, a refused connection, an HTTP error status or a body that is not
JSON all end as one :class:`~dsv41.errors.Dsv41Error` subclass whose message starts with what was
being done (``what``) and says why, e.g. ``cannot list models at http://h:8000: no answer within
10 s (GET http://h:8000/v1/models)``.  Prometheus text is parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

from dsv41.errors import Dsv41Error

# httpx logs every request line at INFO: a fenced HOLD's URL carries its token (a secret)
logging.getLogger("httpx").setLevel(logging.WARNING)


class HttpError(Dsv41Error):
    """An HTTP call of the harness failed (the default error class of :func:`request`)."""


def _reason(exc: Exception, method: str, url: str, timeout_s: float) -> str:
    import httpx

    where = f"({method} {url})"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout_s:g} s {where}"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect: {exc} {where}"
    if isinstance(exc, httpx.HTTPStatusError):
        body = exc.response.text[:200].strip().replace("\n", " ")
        return f"HTTP {exc.response.status_code} {where}" + (f": {body}" if body else "")
    return f"{exc or type(exc).__name__} {where}"


WINDOW_HEADER = "X-DSV41-Window"


_WINDOW_TOKEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsv41_window_token", default=None)


@contextlib.contextmanager
def window_token(token: str | None) -> Iterator[None]:
    """Inside the block, requests carry ``token`` (``""``: none) instead of ``DSV41_WINDOW_TOKEN``:
    an Ansible module passes its ``window_token`` option (itself falling back to that variable)
    explicitly. ``None`` changes nothing."""
    mark = _WINDOW_TOKEN.set(token)
    try:
        yield
    finally:
        _WINDOW_TOKEN.reset(mark)


def window_headers(env=None) -> dict[str, str]:
    """``{"X-DSV41-Window": token}`` while a token is given (:func:`window_token`) or, without
    one, while ``DSV41_WINDOW_TOKEN`` is set (window.yml sets it on the controller during a HOLD:
    the held engine admits only requests carrying it), else ``{}``.
    ``env``: a mapping to read instead of the process environment (tests)."""
    from dsv41 import envs

    tok = _WINDOW_TOKEN.get()
    if tok is None:
        tok = envs.parse(env).window_token
    return {WINDOW_HEADER: tok} if tok else {}


def check_url(url: str, *, what: str, error: type[Dsv41Error] = HttpError) -> str:
    """``url`` when an HTTP client can use it: scheme ``http`` or ``https``, a host, a port (if
    given) in 1-65535 (RFC 6335 section 6; 0 is "any port", never a server's); ``error(what: ...)``
    naming the URL otherwise. httpx raises ``httpx.InvalidURL`` (no ``httpx.HTTPError``, so
    ``http://[::1/metrics`` printed a traceback) and sends ``:99999`` or ``:-1`` to the resolver."""
    import httpx

    try:
        u = httpx.URL(url)
        port = u.port
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise error(f"{what}: {url!r} is not a URL: {exc}") from None
    if u.scheme not in ("http", "https"):
        raise error(f"{what}: {url!r} is not an http:// or https:// URL")
    if not u.host:
        raise error(f"{what}: {url!r} names no host")
    if port is not None and not 1 <= port <= 65535:
        raise error(f"{what}: {url!r} has port {port}, outside 1-65535")
    return url


def auth_headers(
    operator: bool = False, *, what: str = "HTTP request", error: type[Dsv41Error] = HttpError
) -> dict[str, str]:
    """The credentials a project client sends (``dsv41.authz.client_headers``): the API key
    (``DSV41_API_KEY_FILE``) always, the operator credential (``DSV41_OPERATOR_CREDENTIAL_FILE``)
    when ``operator`` (a request that changes a server's state). ``error(what: ...)`` naming the
    file, never the secret, when one cannot be read."""
    from dsv41 import authz

    try:
        return authz.client_headers(operator)
    except authz.CredentialError as exc:
        raise error(f"{what}: {exc}") from None


def request(
    method: str,
    url: str,
    *,
    what: str,
    timeout_s: float = 10.0,
    json: Any = None,
    error: type[Dsv41Error] = HttpError,
    operator: bool = False,
) -> Any:
    """Send one request and return the ``httpx.Response`` (status 2xx).

    ``timeout_s`` bounds connect, each read and write (seconds); environment proxies are ignored
    (``trust_env=False``: lab addresses must not go through an operator's proxy).  Raises
    ``error(f"{what}: <reason>")`` on a timeout, a connection failure, a non-2xx status or any
    other transport error. Carries :func:`window_headers` and :func:`auth_headers` (the operator
    credential only when ``operator``: pause, resume).
    """
    import httpx

    check_url(url, what=what, error=error)
    headers = {**window_headers(), **auth_headers(operator, what=what, error=error)}
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as c:
            r = c.request(method, url, json=json)
            r.raise_for_status()
            r.read()
            return r
    except httpx.HTTPError as exc:
        raise error(f"{what}: {_reason(exc, method, url, timeout_s)}") from exc
    except ValueError as exc:  # an URL httpx cannot use
        raise error(f"{what}: {exc} ({method} {url})") from exc


def request_json(
    method: str,
    url: str,
    *,
    what: str,
    timeout_s: float = 10.0,
    json: Any = None,
    error: type[Dsv41Error] = HttpError,
    operator: bool = False,
) -> Any:
    """:func:`request`, then the body decoded as JSON; ``error`` when it is not JSON."""
    r = request(method, url, what=what, timeout_s=timeout_s, json=json, error=error, operator=operator)
    try:
        return r.json()
    except ValueError as exc:
        raise error(f"{what}: the response is not JSON ({method} {url})") from exc


def metric_samples(
    text: str, *, what: str = "metrics", error: type[Dsv41Error] = HttpError
) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> ``[(sample name, labels, value)]`` in text order, parsed by
    ``prometheus_client.parser.text_string_to_metric_families`` (sample names keep their
    ``_total`` / ``_sum`` / ``_count`` / ``_bucket`` / ``_created`` suffixes).  ``error`` naming
    ``what`` when the text is not valid exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [
            (s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
    except (ValueError, TypeError, IndexError) as exc:
        raise error(f"{what}: not Prometheus text exposition: {exc}") from exc


def get_metrics(
    url: str, *, timeout_s: float = 10.0, error: type[Dsv41Error] = HttpError
) -> list[tuple[str, dict[str, str], float]]:
    """GET a ``/metrics`` URL and parse it (:func:`metric_samples`); ``error`` on failure."""
    what = f"cannot read metrics at {url}"
    return metric_samples(request("GET", url, what=what, timeout_s=timeout_s, error=error).text, what=what, error=error)
