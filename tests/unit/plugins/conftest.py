"""Shared fixtures of the module and plugin tests: the collection import path and running a
module in-process.

The tests import the plugins as the collection ``dsv41.offload`` (as ``ansible-test units`` runs
them). Under plain pytest (``make test``) the repository is not inside an
``ansible_collections/dsv41/offload`` directory, so a temporary one that links to it goes on
``sys.path`` first; under ``ansible-test units`` the collection is importable already.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
UNIT = os.path.join(ROOT, "tests", "unit")


def _collection_on_path() -> None:
    try:
        import ansible_collections.dsv41.offload.plugins  # noqa: F401

        return
    except ImportError:
        pass
    base = tempfile.mkdtemp(prefix="dsv41-collection-")
    atexit.register(shutil.rmtree, base, True)
    os.makedirs(os.path.join(base, "ansible_collections", "dsv41"))
    os.symlink(ROOT, os.path.join(base, "ansible_collections", "dsv41", "offload"))
    sys.path.insert(0, base)
    for name in [m for m in sys.modules if m == "ansible_collections" or m.startswith("ansible_collections.")]:
        del sys.modules[name]  # a namespace package imported before keeps its old __path__


_collection_on_path()
if UNIT not in sys.path:
    sys.path.insert(0, UNIT)  # shared fakes (serverutil.FakeServing)


class _Exit(Exception):
    pass


class _Fail(Exception):
    pass


@pytest.fixture
def run_module(monkeypatch, tmp_path):
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

    # a relative path option (or one Ansible made of a list: "['l']") lands in the test's own
    # directory, never in the repository
    monkeypatch.chdir(tmp_path)
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
