"""The ``vllm.general_plugins`` entry point of the dsv41 package (``dsv41_overlay``).

vLLM calls :func:`register` in its API, engine-core and worker processes when ``VLLM_PLUGINS``
names ``dsv41_overlay`` (or is unset).  ``register`` imports no torch and no vLLM module:

* nothing configured (no ``DSV41_ENGRAM_REMOTE``, no ``DSV41_DRAFTER_REMOTE``): returns, inert;
* a bad setting: raises ConfigError, which stops vLLM (vLLM runs ``register`` outside its
  loader's try block, a fact the contract records);
* the installed vLLM differs from ``vllm_contract.json`` (version, sha256 of a patched or
  relied-on file): raises ContractMismatch in required mode, otherwise logs one line and stays
  inert (vLLM's own Engram tables and drafter);
* otherwise installs post-import hooks that patch vLLM's Engram and speculator modules when (and
  only if) the process imports them (:mod:`dsv41.overlay.hooks`).
"""

from __future__ import annotations

import logging

from dsv41.overlay import contract as C
from dsv41.overlay import settings as S

log = logging.getLogger("dsv41.overlay")

#: Set by :func:`register`: "inert", "contract-mismatch" or "active".
STATE = {"state": "unregistered", "problems": []}


def register() -> None:
    """vLLM's general-plugin hook; see the module docstring.  Safe to call more than once."""
    settings = S.parse()
    if not settings.active:
        STATE.update(state="inert", problems=[])
        return
    contract = C.load()
    root = C.installed_vllm_root()
    problems = (["vLLM is not installed"] if root is None
                else C.check_files(contract, root, C.installed_version()))
    if problems:
        STATE.update(state="contract-mismatch", problems=problems)
        msg = (f"dsv41 overlay: the installed vLLM is not the one in vllm_contract.json "
               f"({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''})")
        if settings.engram and settings.required:
            raise C.ContractMismatch(msg + "; refusing to start because DSV41_ENGRAM_REMOTE_REQUIRED=1")
        log.error("%s; overlay inert: vLLM's own Engram tables and drafter are used", msg)
        return
    from dsv41.overlay import hooks

    hooks.install(settings, contract)
    STATE.update(state="active", problems=[])
    log.info("dsv41 overlay active (vLLM %s): engram %s, drafter %s", contract["vllm_version"],
             "remote" if settings.engram else "vLLM's own", "remote" if settings.drafter else "vLLM's own")
