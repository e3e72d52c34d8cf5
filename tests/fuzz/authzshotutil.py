"""The request generator of the authorization campaign (tests/fuzz/test_authz_campaign.py): one
random request (:class:`Shot`) at a route from a seeded ``random.Random``, each choice labelled,
and the oracle's verdict on it (``permitted``: what ``dsv41.authz.control_refusal`` must let
through); :func:`_request` builds it as httpx sends it.
"""

from __future__ import annotations

import json
import random
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from authutil import TEST_HOSTS  # noqa: E402
from dsv41 import authz  # noqa: E402

HOST = TEST_HOSTS[0]
OTHER_METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH", "get", "put", "delete", "FOO")


HOST = TEST_HOSTS[0]


OTHER_METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH", "get", "put", "delete", "FOO")


@dataclass
class Shot:
    """One generated request and what the oracle says of it (``labels``: the choices made)."""

    method: str
    url: str
    headers: list = field(default_factory=list)
    body: bytes | None = None
    chunked: bool = False
    permitted: bool = False
    read_target: bool = False
    labels: dict = field(default_factory=dict)


def _secret(rng: random.Random) -> str:
    """A credential shaped like ``authz.new_secret()`` (43 URL-safe characters), from the seed."""
    return "".join(rng.choice(string.ascii_letters + string.digits + "-_") for _ in range(43))


def _other_char(rng: random.Random, c: str) -> str:
    return rng.choice([x for x in string.ascii_letters + string.digits if x != c])


def _path(rng: random.Random, path: str) -> tuple[str, str]:
    """A variant of ``path`` as sent on the request line: (label, raw path)."""
    kind = rng.choices(
        [
            "as-is",
            "trailing-slash",
            "doubled-slash",
            "percent",
            "encoded-slash",
            "upper",
            "one-upper",
            "dot-segment",
            "suffix",
        ],
        weights=[40, 8, 8, 10, 4, 6, 6, 4, 4],
    )[0]
    if kind == "trailing-slash":
        return kind, path + "/"
    if kind == "doubled-slash":
        return kind, rng.choice(["/" + path, path.replace("/", "//"), path + "//"])
    if kind == "percent":
        chars = list(path)
        alnum = [i for i, c in enumerate(chars) if c.isalnum()]
        for i in rng.sample(alnum, k=min(3, len(alnum))):
            if rng.random() < 0.6:
                chars[i] = rng.choice(["%{:02X}", "%{:02x}"]).format(ord(chars[i]))
        return kind, "".join(chars)
    if kind == "encoded-slash":
        return kind, rng.choice([path + "%2F", "/%2F" + path[1:], path.replace("_", "%5F")])
    if kind == "upper":
        return kind, path.upper()
    if kind == "one-upper":
        i = rng.randrange(1, len(path))
        return kind, path[:i] + path[i].upper() + path[i + 1 :]
    if kind == "dot-segment":  # a path the OpenAI prefix claims, naming a control route after ".."
        return kind, rng.choice(["/v1/%2e%2e", "/v1/%2E%2E/.", "/v1/.%2e"]) + path
    if kind == "suffix":
        return kind, path + rng.choice(["x", ".json", ";x", "%00"])
    return kind, path


def _query(rng: random.Random) -> list[tuple[str, str]]:
    """Query parameters of a control request: half the time a pause the servers take (a fenced
    one with a window token too, so the HOLD paths run), else the pause's own and junk at random."""
    token = "w" + str(rng.randrange(10**6))
    if rng.random() < 0.5:
        return rng.choice(
            [
                [],
                [("mode", "abort")],
                [("mode", "keep")],
                [("mode", "wait"), ("timeout_s", "5")],
                [("mode", "wait"), ("window", token)],
                [("window", token), ("mode", "wait")],
            ]
        )
    q: list[tuple[str, str]] = []
    for _ in range(rng.choice([0, 1, 2, 3])):
        k = rng.choice(["mode", "mode", "timeout_s", "window", "x"])
        v = {
            "mode": rng.choice(["abort", "wait", "keep", "WAIT", "", "bogus"]),
            "timeout_s": rng.choice(["0.5", "5", "abc", "-1", "nan", "inf"]),
            "window": rng.choice([token, "bad token!", ""]),
            "x": rng.choice(["1", "%", "a b"]),
        }[k]
        q.append((k, v))
    return q


def _credential(rng: random.Random, cred: str) -> tuple[str, list, list, bool]:
    """(label, headers, query parameters, exactly-the-credential) of one credential variant."""
    h = authz.OPERATOR_HEADER
    kinds = [
        "exact",
        "exact",
        "exact",
        "exact",
        "exact",
        "exact",
        "name-case",
        "padded",
        "exact+query",
        "absent",
        "empty",
        "wrong",
        "prefix",
        "suffix",
        "one-changed",
        "twice",
        "comma-twice",
        "two-headers",
        "exact+wrong",
        "wrong+exact",
        "query",
        "cookie",
        "bearer",
        "other-name",
    ]
    kind = rng.choice(kinds)
    i = rng.randrange(1, len(cred))
    wrong = "".join(_other_char(rng, c) for c in cred)
    variants = {
        "exact": ([(h, cred)], [], True),
        "name-case": ([(rng.choice([h.upper(), h.title(), "X-Dsv41-OPERATOR"]), cred)], [], True),
        # RFC 9110 5.5: surrounding whitespace is not part of the field value (h11 strips it)
        "padded": ([(h, rng.choice([" ", "\t", "  "]) + cred + rng.choice(["", " ", "\t"]))], [], True),
        "exact+query": ([(h, cred)], [(h, cred)], True),
        "absent": ([], [], False),
        "empty": ([(h, "")], [], False),
        "wrong": ([(h, wrong)], [], False),
        "prefix": ([(h, cred[:i])], [], False),
        "suffix": ([(h, cred[i:])], [], False),
        "one-changed": ([(h, cred[:i] + _other_char(rng, cred[i]) + cred[i + 1 :])], [], False),
        "twice": ([(h, cred + cred)], [], False),
        "comma-twice": ([(h, f"{cred}, {cred}")], [], False),
        "two-headers": ([(h, cred), (h.upper(), cred)], [], False),
        "exact+wrong": ([(h, cred), (h, wrong)], [], False),
        "wrong+exact": ([(h, wrong), (h, cred)], [], False),
        "query": ([], [(rng.choice([h, "operator", "token", "credential"]), cred)], False),
        "cookie": ([("cookie", f"{rng.choice([h, 'operator', 'session'])}={cred}")], [], False),
        "bearer": ([("authorization", "Bearer " + cred)], [], False),
        "other-name": (
            [(rng.choice(["x-dsv41-operators", "x_dsv41_operator", "x-dsv41-window", "x-operator"]), cred)],
            [],
            False,
        ),
    }
    headers, query, ok = variants[kind]
    return kind, headers, query, ok


def _host(rng: random.Random) -> tuple[str, str | None, bool]:
    """(label, Host header value or None for the client's own, allowed)."""
    good = [
        None,
        None,
        None,
        None,
        HOST.upper(),
        f"{HOST}:8000",
        rng.choice(TEST_HOSTS),
        "127.0.0.1",
        "127.0.0.1:8000",
        "[::1]:8000",
        "localhost",
        "LOCALHOST:80",
    ]
    bad = [
        "attacker.example",
        f"{HOST}.attacker.example",
        "attacker.example:8000",
        "",
        "127.0.0.1.attacker.example",
        "localhost.attacker.example",
        f"{HOST}@attacker.example",
        "0x7f.1",
        f"{HOST}:80:80",
    ]
    if rng.random() < 0.75:
        v = rng.choice(good)
        return ("default" if v is None else "allowed"), v, True
    return "foreign", rng.choice(bad), False


def _origin(rng: random.Random, host: str) -> tuple[str, list, bool]:
    """(label, Origin headers, no cross-origin marker) relative to the Host sent."""
    kind = rng.choices(
        ["absent", "same", "same-https", "foreign", "null", "host-suffix", "two"], weights=[60, 12, 6, 8, 5, 5, 4]
    )[0]
    value = {
        "same": f"http://{host}",
        "same-https": f"https://{host}",
        "foreign": "http://attacker.example",
        "null": "null",
        "host-suffix": f"http://{host}.attacker.example",
    }.get(kind)
    if kind == "absent":
        return kind, [], True
    if kind == "two":
        return kind, [("origin", f"http://{host}"), ("origin", "http://attacker.example")], False
    return kind, [("origin", value)], kind in ("same", "same-https")


def _fetch_site(rng: random.Random) -> tuple[str, list, bool]:
    """(label, Sec-Fetch-Site headers, same-origin or none)."""
    v = rng.choices(
        [None, "same-origin", "none", "Same-Origin", "cross-site", "same-site", "", "same-origin, cross-site"],
        weights=[60, 8, 6, 4, 8, 6, 4, 4],
    )[0]
    if v is None:
        return "absent", [], True
    return v or "empty", [("sec-fetch-site", v)], v.strip().lower() in ("same-origin", "none")


def _body(rng: random.Random) -> tuple[str, str | None, bytes | None, bool, bool]:
    """(label, content type, body, chunked, JSON or nothing)."""
    js = json.dumps({"mode": rng.choice(["abort", "wait", "keep", "x"])}).encode()
    junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    choices = {
        "none": (None, None, False, True),
        "json": ("application/json", js, False, True),
        "json-charset": ("application/json; charset=utf-8", js, False, True),
        "json-upper": ("Application/JSON", js, False, True),
        "json-empty": ("application/json", b"", False, True),
        "json-junk": ("application/json", junk, False, True),  # typed JSON: the route refuses it (400)
        "json-chunked": ("application/json", js, True, True),
        "text-plain": ("text/plain", js, False, False),
        "text-plain-empty": ("text/plain", b"", False, False),
        "form": ("application/x-www-form-urlencoded", b"mode=wait", False, False),
        "multipart": ("multipart/form-data; boundary=x", b"--x\r\n\r\nwait\r\n--x--", False, False),
        "untyped-json": (None, js, False, False),
        "untyped-junk": (None, junk, False, False),
        "untyped-chunked": (None, junk, True, False),
        "octet-stream": ("application/octet-stream", junk, False, False),
        "json-lookalike": (
            rng.choice(["application/json-patch+json", "text/json", "application/jsonx"]),
            js,
            False,
            False,
        ),
    }
    kind = rng.choices(list(choices), weights=[30, 14, 4, 3, 3, 3, 3, 6, 3, 5, 3, 5, 5, 3, 4, 4])[0]
    ctype, body, chunked, ok = choices[kind]
    return kind, ctype, body, chunked, ok


def make_shot(rng: random.Random, cred: str, target: tuple[str, str], read_target: bool) -> Shot:
    """A random request at ``target`` ``(method, path)`` and the oracle's verdict on it."""
    method, path = target
    r = rng.random()
    method = method if r < 0.6 else method.lower() if r < 0.72 else rng.choice(OTHER_METHODS)
    path_kind, raw_path = _path(rng, path)
    cred_kind, cred_headers, cred_query, cred_ok = _credential(rng, cred)
    host_kind, host, host_ok = _host(rng)
    origin_kind, origin_headers, origin_ok = _origin(rng, HOST if host is None else host)
    fetch_kind, fetch_headers, fetch_ok = _fetch_site(rng)
    body_kind, ctype, body, chunked, body_ok = _body(rng)
    query = _query(rng) + cred_query
    rng.shuffle(query)
    headers = cred_headers + origin_headers + fetch_headers
    if host is not None:
        headers.append(("host", host))
    if ctype is not None:
        headers.append(("content-type", ctype))
    url = f"http://{HOST}{raw_path}" + ("?" + urlencode(query) if query else "")
    permitted = cred_ok and host_ok and origin_ok and fetch_ok and body_ok
    labels = {
        "method": method,
        "path": path_kind,
        "credential": cred_kind,
        "host": host_kind,
        "origin": origin_kind,
        "fetch": fetch_kind,
        "body": body_kind,
        "url": url.replace(cred, "<CRED>"),
    }
    return Shot(method, url, headers, body, chunked, permitted=permitted, read_target=read_target, labels=labels)


def _request(client, shot: Shot) -> httpx.Request:
    """The httpx request of ``shot``; the method is set after building, as sent (httpx upper-cases
    it; a server gets a lower-case method as the client wrote it)."""
    content = shot.body
    if shot.chunked:
        data = shot.body or b""
        if isinstance(client, httpx.AsyncClient):

            async def agen():
                yield data[: len(data) // 2]
                yield data[len(data) // 2 :]

            content = agen()
        else:
            content = iter([data[: len(data) // 2], data[len(data) // 2 :]])
    req = client.build_request(shot.method.upper(), shot.url, headers=shot.headers, content=content)
    req.method = shot.method
    return req
