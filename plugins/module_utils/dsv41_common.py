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


def require_dsv41(module):
    """Fail ``module`` (an AnsibleModule) with Ansible's standard "requires dsv41" message and the
    import traceback as ``exception`` when an import_dsv41() failed; return otherwise."""
    if DSV41_IMPORT_ERROR is not None:
        module.fail_json(msg=missing_required_lib("dsv41"), exception=DSV41_IMPORT_ERROR)


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
