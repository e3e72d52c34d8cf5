"""JSON and YAML text, strict: what every reader parses with (:func:`loads_json`,
:func:`loads_yaml`) and every writer encodes with (:func:`dumps_json`, never ``NaN``/``Infinity``).

Ground floor (stdlib, PyYAML inside :func:`loads_yaml`, and :mod:`dsv41.errors` only). The file
side (regular inputs, atomic outputs) is :mod:`dsv41.fileio`, which re-exports these names:
callers write ``fileio.loads_json`` / ``fileio.dumps_json``.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from dsv41.errors import Dsv41Error


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259 section 6 has no NaN or infinities)")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _refused(message: str) -> json.JSONDecodeError:
    exc = json.JSONDecodeError(message, "", 0)
    exc.args = (message,)  # no "line 1 column 1": the position is not known
    return exc


def loads_json(text: str | bytes, *, finite: bool = True) -> Any:
    """``json.loads`` for what the project reads from files, subprocesses and peers, strict.

    Refused, each as :class:`json.JSONDecodeError` (a ``ValueError``, what every caller of
    ``json.loads`` already catches): ``NaN``/``Infinity``/``-Infinity`` (Python's extension; not
    JSON, RFC 8259 section 6; a NaN passes every range check after it), a key given twice in one
    object (RFC 8259 section 4: names "SHOULD be unique"; Python keeps the last silently, so two
    readers of one file could disagree), and nesting deep enough to hit Python's recursion limit
    (``RecursionError`` is no ``ValueError`` and printed a traceback). The parsed value otherwise.
    ``finite=False`` reads ``NaN``/``Infinity`` as floats: only for records the package wrote
    before :func:`dumps_json` (a window decision's open CI was ``[-1.0, Infinity]``; it is
    now ``[-1.0, null]`` with the reason under ``nonfinite``).
    """
    try:
        return json.loads(text, object_pairs_hook=_pairs, **({"parse_constant": _constant} if finite else {}))
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise _refused("nested too deeply (Python's recursion limit)") from None
    except ValueError as exc:  # _constant, _pairs, an integer past sys.get_int_max_str_digits()
        raise _refused(str(exc)) from None


class EncodeError(Dsv41Error, ValueError):
    """A value cannot be written as JSON: a non-finite float where the writer refuses them, or an
    object ``json`` cannot encode. A ``ValueError`` too (what ``json.dumps`` raised before)."""


#: The key under which ``dumps_json(..., nonfinite="null")`` records what each ``null`` stood for.
NONFINITE_KEY = "nonfinite"


def _pointer(path: tuple) -> str:
    # RFC 6901 JSON Pointer: "~" -> "~0", "/" -> "~1"
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path) or "/"


def _nonfinite_name(x: float) -> str:
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


def _finite_copy(obj: Any, path: tuple, found: dict[str, str]) -> Any:
    """``obj`` with every non-finite float (``float`` and its subclasses, numpy's float64) in dicts,
    lists and tuples replaced by None, each recorded in ``found`` as ``{pointer: "nan"|"inf"|"-inf"}``."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        found[_pointer(path)] = _nonfinite_name(obj)
        return None
    if isinstance(obj, dict):
        return {k: _finite_copy(v, (*path, k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_copy(v, (*path, i), found) for i, v in enumerate(obj)]
    return obj


def dumps_json(
    obj: Any,
    *,
    nonfinite: str = "refuse",
    indent: int | str | None = None,
    sort_keys: bool = False,
    separators: tuple[str, str] | None = None,
    ensure_ascii: bool = True,
    default: Any = None,
    cls: type[json.JSONEncoder] | None = None,
    what: str | None = None,
) -> str:
    """``json.dumps`` for everything the project writes (files, stdout, peers, digests), never with
    ``NaN``/``Infinity`` in it (``allow_nan=False`` always).

    Python's ``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default: not JSON
    (RFC 8259 section 6), refused by :func:`loads_json`, by ``jq`` and by most other readers, so a
    record holding one could not be read back. What a non-finite value becomes is the writer's
    choice, given as ``nonfinite``:

    * ``"refuse"`` (default): raise :class:`EncodeError` naming the value's JSON Pointer (RFC 6901),
      e.g. ``cannot write window decision: /ci/0 is -inf, not a JSON number``. For canonical bytes
      and digests (manifests, promotion packages, the journal), requests to peers, and documents
      that cannot hold one.
    * ``"null"``: for measurement records (a window's decision, bench and drill reports, status
      facts, scraped metrics), where a measurement that has no finite value (a CI nothing bounds, a
      ratio over zero, a scraped ``NaN``) must not cost the record: each such float is written as
      ``null`` and the reason is recorded in the document, under :data:`NONFINITE_KEY` of the top
      object: ``{"nonfinite": {"/decision/ci/0": "-inf", ...}}`` (the pointers into the document as
      written; a document that already has that key is refused rather than overwritten). A document
      that is not a JSON object has no place for the reason and is refused as with ``"refuse"``.

    The other arguments are ``json.dumps``'s. Raises :class:`EncodeError` (also for an object
    ``json`` cannot encode: ``TypeError`` in ``json.dumps``) and ``ValueError`` for an unknown
    ``nonfinite``. Non-finite floats produced by ``default``/``cls`` are refused in either mode.
    """
    if nonfinite not in ("refuse", "null"):
        raise ValueError(f"nonfinite must be 'refuse' or 'null', got {nonfinite!r}")
    label = f"cannot write {what}" if what else "cannot write JSON"
    found: dict[str, str] = {}
    doc = _finite_copy(obj, (), found) if nonfinite == "null" else obj
    if found:
        if not isinstance(doc, dict) or NONFINITE_KEY in doc:
            where = (
                "it is not a JSON object" if not isinstance(doc, dict) else f"it already has a {NONFINITE_KEY!r} key"
            )
            raise EncodeError(
                f"{label}: {', '.join(f'{p} is {v}' for p, v in found.items())}, not a JSON number, "
                f"and the reason cannot be recorded ({where})"
            )
        doc = {**doc, NONFINITE_KEY: found}
    try:
        return json.dumps(
            doc,
            indent=indent,
            sort_keys=sort_keys,
            separators=separators,
            ensure_ascii=ensure_ascii,
            default=default,
            cls=cls,
            allow_nan=False,
        )
    except ValueError as exc:  # a non-finite float (allow_nan=False) or a circular reference
        bad: dict[str, str] = {}
        with contextlib.suppress(RecursionError):
            _finite_copy(doc, (), bad)
        if not bad:  # made by default/cls, or a circular reference: json's own words
            raise EncodeError(f"{label}: {exc}") from None
        raise EncodeError(
            f"{label}: {', '.join(f'{p} is {v}' for p, v in bad.items())}, not a JSON number (RFC 8259 section 6)"
        ) from None
    except (TypeError, RecursionError) as exc:
        raise EncodeError(f"{label}: {exc}") from None


def loads_yaml(text: str) -> Any:
    """``yaml.safe_load`` for what the project reads (candidates, role defaults), strict like
    :func:`loads_json`.

    Refused, each as ``yaml.YAMLError`` (what callers of ``safe_load`` already catch), with the
    line: a key given twice in one mapping (YAML 1.2 section 3.2.1.1: keys are unique; PyYAML
    keeps the last silently, so ``min_effect: 0.05`` then ``min_effect: 0.5`` judged with 0.5),
    ``.nan``/``.inf`` floats (JSON Schema's ``minimum``/``maximum`` pass a NaN: a candidate with
    ``min_effect: .nan`` validated and printed ``NaN``, which is not JSON), and nesting past
    Python's recursion limit. Aliases construct shared objects (no expansion), as in safe_load.
    """
    import math

    import yaml

    class _Strict(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:  # unhashable: SafeLoader's own error names it
                    break
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found key {key!r} twice in one mapping",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_float(self, node):
            value = super().construct_yaml_float(node)
            if not math.isfinite(value):
                raise yaml.constructor.ConstructorError(
                    None, None, f"{node.value!r} is not a finite number", node.start_mark
                )
            return value

    _Strict.add_constructor("tag:yaml.org,2002:float", _Strict.construct_yaml_float)
    try:
        return yaml.load(text, Loader=_Strict)  # noqa: S506 - _Strict is a SafeLoader
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (Python's recursion limit)") from None
