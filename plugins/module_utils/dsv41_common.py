# Apache License 2.0
"""Shared by the dsv41 modules: the guarded import of the dsv41 package, the mapping of its
errors onto ``fail_json`` and the ``window_token`` option (spec here, documentation in the
doc fragment ``dsv41.offload.window_token``).

Modules reach this file as ``ansible.module_utils.dsv41_common`` when they run from ``library/``
(``ansible.cfg``: ``module_utils = plugins/module_utils``) and as
``ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common`` inside the collection
(``ansible-test``); each module tries the collection path first.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import traceback

from ansible.module_utils.basic import env_fallback, missing_required_lib

# The first failed import's traceback; require_dsv41() reports it.
DSV41_IMPORT_ERROR = None

try:
    from dsv41.errors import Dsv41Error
except ImportError:
    DSV41_IMPORT_ERROR = traceback.format_exc()

    class Dsv41Error(Exception):
        """Stand-in so that ``except Dsv41Error`` compiles; require_dsv41() fails before it matters."""


def import_dsv41(name):
    """Import the dsv41 submodule ``name`` (e.g. ``"dsv41.harness.admission"``) at module load.

    Returns the Python module, or None when it (or a dependency) cannot be imported on this host;
    the traceback is kept for require_dsv41(). Never raises, so a module's documentation still
    loads (ansible-doc, ansible-test) on a machine without the package.
    """
    global DSV41_IMPORT_ERROR
    try:
        return importlib.import_module(name)
    except ImportError:
        DSV41_IMPORT_ERROR = DSV41_IMPORT_ERROR or traceback.format_exc()
        return None


# Integers a module option may hold: a signed 64-bit range. Ansible's ``int`` type converts any
# digit string, and one past 4300 digits cannot even be printed (``repr``/``json.dumps`` raise
# ValueError, sys.get_int_max_str_digits()), so the module's own result would be a traceback.
INT_LIMIT = 2**63


def _nul(value):
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, (list, tuple)):
        return any(_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_nul(k) or _nul(v) for k, v in value.items())
    return False


def option_problem(kind, value):
    """Why ``value`` (already converted by Ansible to option type ``kind``) is unusable, or None.

    ``int``: outside [-2^63, 2^63); ``float``: NaN or an infinity (Ansible's ``float`` type takes
    ``"nan"`` and ``"inf"``; NaN passes every range check after it); any string, also inside a
    list or dict: a NUL byte (no path, URL, argv or header can hold one: ``open`` and ``os.stat``
    raise ValueError).
    """
    import math

    if value is None:
        return None
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        return f"{value.bit_length()}-bit integer, outside the 64-bit range"
    if kind == "float" and isinstance(value, float) and not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if _nul(value):
        return "contains a NUL byte"
    return None


# Option types whose value must arrive as a string.
STRING_TYPES = ("str", "path")


def _short(value):
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def not_a_string(spec, raw, prefix=""):
    """``(option name, value)`` of the first ``str``/``path`` option (also a ``list`` of them, and
    in ``options`` of a dict or list of dicts) whose value in ``raw`` (the arguments as sent,
    before Ansible's conversion) is not a string; None when there is none.

    Why: Ansible's ``str`` and ``path`` types convert any value to its text (ansible-core 2.19
    ``check_type_str`` always converts; the ``string_conversion_action`` setting that could make
    this an error is gone), so a list given as ``out_dir`` became the directory ``['l']`` in the
    caller's working directory. Numbers and booleans are refused too: YAML reads an unquoted
    ``0755``, ``1e3`` or ``yes`` as a number or a boolean whose text is not what was written.
    None (an unset option) passes."""
    if not isinstance(raw, dict):
        return None
    for name, o in spec.items():
        value = raw.get(name)
        if value is None:
            continue
        kind, label = o.get("type", "str"), f"{prefix}{name}"
        if kind in STRING_TYPES and not isinstance(value, str):
            return label, value
        if kind == "list" and o.get("elements") in STRING_TYPES and isinstance(value, list):
            for i, v in enumerate(value):
                if v is not None and not isinstance(v, str):
                    return f"{label}[{i}]", v
        if o.get("options"):
            for i, item in enumerate(value if kind == "list" and isinstance(value, list) else [value]):
                found = not_a_string(o["options"], item, f"{label}[{i}]." if kind == "list" else f"{label}.")
                if found:
                    return found
    return None


def _arguments_as_sent():
    """The module's arguments as the controller sent them, before type conversion
    (``ansible.module_utils.basic._load_params``, which ansible-core documents for modules that
    must see the parameters as handed over); ``{}`` when they cannot be read again."""
    try:
        from ansible.module_utils.basic import _load_params

        raw = _load_params()
    except Exception:  # noqa: BLE001 - nothing to compare with: the checks on converted values still run
        return {}
    return raw if isinstance(raw, dict) else {}


def check_options(module):
    """Fail ``module`` naming the first option of its ``argument_spec`` whose value is unusable:
    a ``str``/``path`` option given something that is not a string (:func:`not_a_string`), or a
    value :func:`option_problem` refuses; the value itself is replaced in ``module.params`` first,
    so the failure's ``invocation`` can be serialised."""
    found = not_a_string(module.argument_spec, _arguments_as_sent())
    if found:
        name, value = found
        module.fail_json(
            msg=f"option {name}: {type(value).__name__} {_short(value)} is not a string "
            f"(Ansible would use its text {_short(str(value))}; quote the value or fix the variable)"
        )
    for name, spec in module.argument_spec.items():
        problem = option_problem(spec.get("type", "str"), module.params.get(name))
        if problem is not None:
            module.params[name] = f"<refused: {problem}>"
            module.fail_json(msg=f"option {name}: {problem}")


def require_dsv41(module):
    """Fail ``module`` (an AnsibleModule) with Ansible's standard "requires dsv41" message and the
    import traceback as ``exception`` when an import_dsv41() failed, or naming an option whose
    value no module can use (:func:`check_options`); return otherwise."""
    if DSV41_IMPORT_ERROR is not None:
        module.fail_json(msg=missing_required_lib("dsv41"), exception=DSV41_IMPORT_ERROR)
    check_options(module)


@contextlib.contextmanager
def dsv41_errors(module, **details):
    """Turn an expected dsv41 failure (``Dsv41Error``, one line) into ``module.fail_json``.

    ``details`` are returned with the failure (for example the endpoint). Other exceptions
    propagate: they are bugs, and Ansible shows them with their traceback.
    """
    try:
        yield
    except Dsv41Error as exc:
        module.fail_json(msg=str(exc), **details)


# The argument spec of the window_token option and the credential files (documented by
# plugins/doc_fragments/window_token.py): every module whose requests go through dsv41.harness.http
# merges it into its argument_spec. The token is a secret (it admits requests past a fenced HOLD):
# no_log. The files are paths, their contents never pass through Ansible.
WINDOW_TOKEN_SPEC = dict(
    window_token=dict(type="str", default="", no_log=True, fallback=(env_fallback, ["DSV41_WINDOW_TOKEN"])),
    operator_credential_file=dict(type="path", default="", fallback=(env_fallback, ["DSV41_OPERATOR_CREDENTIAL_FILE"])),
    api_key_file=dict(type="path", default="", fallback=(env_fallback, ["DSV41_API_KEY_FILE"])),
)
# The environment variable dsv41.harness.http reads each credential file from.
_CREDENTIAL_ENV = (
    ("operator_credential_file", "DSV41_OPERATOR_CREDENTIAL_FILE"),
    ("api_key_file", "DSV41_API_KEY_FILE"),
)


def window_token(module):
    """Context manager: the module's requests (through ``dsv41.harness.http``) carry
    ``module.params["window_token"]`` (``""``: none) until it exits; ``http.window_token``
    restores what was set before. The credential files named by the module's options are put in
    this (short-lived) module process's environment, where ``dsv41.authz.client_headers`` reads
    them. Call it after require_dsv41()."""
    http = import_dsv41("dsv41.harness.http")
    for opt, var in _CREDENTIAL_ENV:
        if module.params.get(opt):
            os.environ[var] = module.params[opt]
    return http.window_token(module.params["window_token"])
