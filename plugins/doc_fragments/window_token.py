# Apache License 2.0
"""Documentation fragment ``dsv41.offload.window_token``: the ``window_token`` option of every
module whose requests go through ``dsv41.harness.http`` (its argument spec is
``dsv41_common.WINDOW_TOKEN_SPEC``)."""

from __future__ import annotations


class ModuleDocFragment:
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
      - A secret (it admits requests past the HOLD); never logged.
    type: str
    default: ""
  operator_credential_file:
    description:
      - File (mode 0600) holding the operator credential rank 0 requires on C(/pause) and C(/resume);
        sent in the C(X-DSV41-Operator) header of those requests only.
      - Falls back to E(DSV41_OPERATOR_CREDENTIAL_FILE); V("") sends none (a control request is then refused).
    type: path
    default: ""
  api_key_file:
    description:
      - "File (mode 0600) holding the OpenAI API key rank 0 requires when it runs with vLLM's
        C(--api-key) / E(VLLM_API_KEY); sent as C(Authorization: Bearer KEY)."
      - Falls back to E(DSV41_API_KEY_FILE); V("") sends none.
    type: path
    default: ""
"""
