"""Promotion packages and the promotion journal (docs/promotion.md).

``package``: build, store, load, verify and compare content-addressed packages (one complete
production configuration each); ``journal``: the controller's append-only step log and the replay
decision after an interruption; ``cli``: ``dsv41 package show|diff|verify|list|journal``.
Floor 5, beside ``harness`` (tests/unit/test_import_floors.py); imports only ``errors``.
"""
