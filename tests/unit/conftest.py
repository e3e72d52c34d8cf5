"""Shared set-up of the unit tests (the module and plugin tests have theirs in plugins/conftest.py)."""
