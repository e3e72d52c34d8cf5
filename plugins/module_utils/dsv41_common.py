# -*- coding: utf-8 -*-
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
INT_LIMIT = 2 ** 63


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


def check_options(module):
    """Fail ``module`` naming the first option of its ``argument_spec`` whose value
    :func:`option_problem` refuses; the value itself is replaced in ``module.params`` first, so the
    failure's ``invocation`` can be serialised."""
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


# The argument spec of the window_token option (documented by plugins/doc_fragments/window_token.py):
# every module whose requests go through dsv41.harness.http merges it into its argument_spec.
# no_log=False: the token names a fenced run (it is in the journal and the logs), it is no secret.
WINDOW_TOKEN_SPEC = dict(
    window_token=dict(type="str", default="", no_log=False, fallback=(env_fallback, ["DSV41_WINDOW_TOKEN"])),
)


def window_token(module):
    """Context manager: the module's requests (through ``dsv41.harness.http``) carry
    ``module.params["window_token"]`` (``""``: none) until it exits; ``http.window_token``
    restores what was set before. Call it after require_dsv41()."""
    http = import_dsv41("dsv41.harness.http")
    return http.window_token(module.params["window_token"])
