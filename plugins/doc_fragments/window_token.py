# -*- coding: utf-8 -*-
# Apache License 2.0
"""Documentation fragment ``dsv41.offload.window_token``: the ``window_token`` option of every
module whose requests go through ``dsv41.harness.http`` (its argument spec is
``dsv41_common.WINDOW_TOKEN_SPEC``)."""
from __future__ import annotations


class ModuleDocFragment(object):
    """The ``window_token`` option, merged into a module's DOCUMENTATION by
    ``extends_documentation_fragment: [dsv41.offload.window_token]``."""

    DOCUMENTATION = r"""
options:
  window_token:
    description:
      - The fenced operation's token (window, promote, rollback). While a HOLD carries it, the held
        engine admits only requests with it; this module's requests carry it (M(dsv41.offload.admission)
        also sends it with a HOLD).
      - Falls back to E(DSV41_WINDOW_TOKEN) (what a play's C(environment:) sets); V("") sends none.
    type: str
    default: ""
"""
