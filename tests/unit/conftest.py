"""Shared fixtures of the unit tests: running the custom Ansible modules in-process.

The modules in ``library/`` are imported by name, so ``library/`` goes on ``sys.path`` here, before
the test files import them.
"""

from __future__ import annotations

import os
import sys

import pytest

LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "library")
sys.path.insert(0, LIBRARY)


class _Exit(Exception):
    pass


class _Fail(Exception):
    pass


@pytest.fixture
def run_module(monkeypatch):
    """Run a module's ``main()`` with ``args`` (ansible-core 2.19 ``patch_module_args``).

    Returns ``(kind, result)``: ``("exit", exit_json kwargs)`` or ``("fail", fail_json kwargs incl.
    msg)``; a module that returns without either is a test failure.
    """
    from ansible.module_utils import basic
    from ansible.module_utils.testing import patch_module_args

    def _exit(self, **kw):
        raise _Exit(kw)

    def _fail(self, msg, **kw):
        kw["msg"] = msg
        raise _Fail(kw)

    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail)

    def _run(mod, args):
        with patch_module_args(args):
            try:
                mod.main()
            except _Exit as e:
                return "exit", e.args[0]
            except _Fail as e:
                return "fail", e.args[0]
        raise AssertionError("module returned without exit_json/fail_json")

    return _run
