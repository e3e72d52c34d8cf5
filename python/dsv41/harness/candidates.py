"""Candidate files: ``candidates/NAME.yml``, the named configuration deltas a window measures.

One module for everything a candidate file means: its schema (``schemas/candidate.schema.json``,
:data:`CANDIDATE_SCHEMA`), reading and validating it (:func:`load_candidate`), the Ansible role
variables of its arm (:func:`role_vars`, :data:`ROLE_VARS`), the check that a window can restore
what it changes (:func:`check_restorable`, :data:`DERIVED_ENV`) and all of these together with its
workload spec resolved, as ``dsv41 window plan`` needs them (:func:`load_checked`). Callers:
``harness.window_plan`` (window.yml's plan), ``dsv41 window candidate`` (promote.yml).

Every refusal is one :class:`CandidateError` line (a :class:`~dsv41.harness.window.WindowError`),
raised before anything is held or written.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsv41 import envs, fileio
from dsv41.harness import bench
from dsv41.harness.window import WindowError
from dsv41.names import check_name

CANDIDATE_SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "candidate.schema.json"
#: Candidate role settings ``(role, key)`` -> the role variable that templates them (re-running
#: the role with production's values restores the file byte for byte; nothing else may be
#: changed). Every ``roles.<role>.<key>`` the schema admits has an entry.
ROLE_VARS = {
    ("serve", "env"): "serve_extra_env",
    ("engram_server", "env"): "engram_server_extra_env",
    ("spec_decode", "async"): "spec_decode_async",
    ("spec_decode", "k"): "spec_decode_k",
    ("spec_decode", "timeout_ms"): "spec_decode_timeout_ms",
    # `vllm serve`'s arguments (roles/serve vars serve_vllm_config_args): the unit's launch line
    ("serve", "vllm_max_model_len"): "serve_vllm_max_model_len",
    ("serve", "vllm_max_num_seqs"): "serve_vllm_max_num_seqs",
    ("serve", "vllm_kv_cache_gib"): "serve_vllm_kv_cache_gib",
    ("serve", "vllm_gpu_memory_utilization"): "serve_vllm_gpu_memory_utilization",
    ("serve", "vllm_max_num_queued_reqs"): "serve_vllm_max_num_queued_reqs",
}
#: The serving runtimes (roles/dsv41 ``dsv41_serve_runtime``): only ``vllm`` reads the
#: ``vllm_*`` serving arguments; the stand-in engine (``lab``) has no such flags.
SERVE_RUNTIMES = ("vllm", "lab")
#: Variables the roles derive from production's own files (digests, paths): a candidate that set
#: them would change what production's inputs are said to be, not a setting; refused.
DERIVED_ENV = frozenset(
    {
        "DSV41_SERVE_INPUTS_SHA256",
        "DSV41_TABLES_MANIFEST",
        "DSV41_TABLES_MANIFEST_SHA256",
        "DSV41_DRAFTER_FILES_SHA256",
        "DSV41_WINDOW_TOKEN",
        # who may change production is not a setting a window measures
        "DSV41_OPERATOR_CREDENTIAL_FILE",
        "DSV41_CONTROL_HOSTS",
        "DSV41_API_KEY_FILE",
    }
)


class CandidateError(WindowError):
    """A candidate file that is unknown, unreadable, off its schema or not restorable."""


#: Jinja's delimiters (Ansible templates any trusted string holding one): a value from a
#: candidate, an arm file or a package that holds one is refused, never handed to Ansible.
TEMPLATE_MARKS = ("{{", "{%", "{#", "}}", "%}", "#}")


def check_data(doc: object, where: str, error: type[WindowError] = CandidateError) -> None:
    """Refuse (``error``, one line naming ``where`` and the JSON path) any key or string value of
    ``doc`` (nested dicts and lists) that holds Jinja template syntax (:data:`TEMPLATE_MARKS`) or
    a control character: data read from files reaches Ansible as data, never as code."""

    def walk(x: object, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(k, f"{path}/{k!s}"[:200] + " (key)")
                walk(v, f"{path}/{k!s}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif isinstance(x, str):
            mark = next((m for m in TEMPLATE_MARKS if m in x), None)
            if mark is not None:
                raise error(f"{where}: {path or '(top)'} holds template syntax {mark!r}; values are data, never code")
            if any(ord(c) < 32 and c not in "\t\n" for c in x):
                raise error(f"{where}: {path or '(top)'} holds a control character")

    walk(doc, "")


#: The keys of a window arm file (``windows/<id>/arms/<candidate>-<arm>.json``, window.yml).
ARM_KEYS = frozenset({"window_arm", "window_switch_roles"})


def load_arm(path: str | os.PathLike) -> dict:
    """Read a window arm file as data: a JSON object with exactly :data:`ARM_KEYS`
    (``window_arm``: {role variable: value} of :data:`ROLE_VARS`' variables, plus the fault
    drill's serve settings; ``window_switch_roles``: role names), no template syntax anywhere
    (:func:`check_data`). Returns it; raises CandidateError (one line) otherwise.
    ``playbooks/window_switch.yml`` loads every arm through this (``dsv41 window arm``)."""
    doc = fileio.read_json(path, "window arm file", max_bytes=1 << 20, error=CandidateError)
    if not isinstance(doc, dict) or set(doc) != ARM_KEYS:
        raise CandidateError(
            f"window arm file {path}: must be a JSON object with exactly {', '.join(sorted(ARM_KEYS))}"
        )
    if not isinstance(doc["window_arm"], dict) or not (
        isinstance(doc["window_switch_roles"], list) and all(isinstance(r, str) for r in doc["window_switch_roles"])
    ):
        raise CandidateError(
            f"window arm file {path}: window_arm must be an object and window_switch_roles a list of role names"
        )
    for r in doc["window_switch_roles"]:
        check_name(r, "window arm file role", CandidateError)
    check_data(doc, f"window arm file {path}")
    return doc


def load_candidate(name: str, root: str | os.PathLike = "candidates") -> dict:
    """Read and validate ``root/NAME.yml`` against :data:`CANDIDATE_SCHEMA` (JSON Schema
    draft 2020-12); returns the parsed document (``name``, ``question``, ``kind``,
    ``primary_metric``, ``min_effect``, optional ``spec`` and ``roles``).

    Raises CandidateError for a name that is not a plain file name, an unknown name (listing
    the known ones), unreadable YAML, a schema error (naming the JSON path) or a ``name`` field
    that differs from the file name; all of this happens before any HOLD is taken."""
    import jsonschema
    import yaml

    check_name(name, "candidate name", CandidateError)
    path = Path(root) / f"{name}.yml"
    if not path.is_file():
        known = sorted(p.stem for p in Path(root).glob("*.yml")) if Path(root).is_dir() else []
        raise CandidateError(f"unknown candidate {name!r} (no {path}); known: {', '.join(known) or 'none'}")
    try:
        doc = fileio.loads_yaml(fileio.read_text(path, "candidate", error=CandidateError))
    except yaml.YAMLError as exc:
        problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
        why = f"{problem} (line {mark.line + 1})" if problem and mark else str(exc).splitlines()[0]
        raise CandidateError(f"candidate {path} is not readable YAML: {why}") from None
    schema = fileio.loads_json(CANDIDATE_SCHEMA.read_text())
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    if err is not None:
        loc = "/".join(str(x) for x in err.absolute_path) or "(top)"
        raise CandidateError(f"candidate {path} fails its schema at {loc}: {err.message}")
    if doc["name"] != name:
        raise CandidateError(f"candidate {path} is named {doc['name']!r}; the file name says {name!r}")
    check_data(doc, f"candidate {path}")
    return doc


def role_vars(candidate: dict) -> dict:
    """The Ansible extra variables of a candidate's arm, ``{role variable: value}`` (names from
    :data:`ROLE_VARS`); env deltas are returned as dicts to be combined over production's
    ``*_extra_env``. ``candidate``: a document :func:`load_candidate` returned; ``{}`` when it
    changes nothing (an A/A window)."""
    out: dict = {}
    for role, settings in candidate.get("roles", {}).items():
        for key, value in settings.items():
            out[ROLE_VARS[(role, key)]] = value
    return out


def check_restorable(doc: dict) -> None:
    """Raise CandidateError when a candidate's delta touches something the window cannot restore
    or judge: an env variable unknown to ``dsv41.envs`` (no role would template it back, and
    the engine refuses unknown names) or one the roles derive from production files
    (:data:`DERIVED_ENV`). Settings outside the roles' env files cannot be expressed at all
    (:data:`CANDIDATE_SCHEMA`)."""
    for role, settings in doc.get("roles", {}).items():
        for name in sorted(settings.get("env") or {}):
            if name not in envs.ENV_VARS:
                raise CandidateError(
                    f"candidate {doc['name']!r}: {role} env {name} is not a dsv41 variable "
                    f"(python/dsv41/envs.py); the window cannot restore what no role templates"
                )
            if name in DERIVED_ENV:
                raise CandidateError(
                    f"candidate {doc['name']!r}: {role} env {name} is derived by the role from "
                    f"production's files; a window may not set it"
                )


def check_runtime(doc: dict, serve_runtime: str) -> None:
    """Raise CandidateError when a candidate sets vLLM serving arguments (``roles.serve.vllm_*``)
    for Sparks that do not serve vLLM: under the stand-in engine nothing would change, and a
    window would report an A/A as the candidate's effect. ``serve_runtime``: ``vllm`` or ``lab``
    (:data:`SERVE_RUNTIMES`, the inventory's ``dsv41_serve_runtime``); another value is refused."""
    if serve_runtime not in SERVE_RUNTIMES:
        raise CandidateError(f"serve runtime must be one of {', '.join(SERVE_RUNTIMES)}, not {serve_runtime!r}")
    vllm = sorted(k for k in (doc.get("roles", {}).get("serve") or {}) if k.startswith("vllm_"))
    if vllm and serve_runtime != "vllm":
        raise CandidateError(
            f"candidate {doc['name']!r} sets vLLM serving arguments ({', '.join(vllm)}) but the Sparks "
            f"serve with dsv41_serve_runtime={serve_runtime}: nothing would change"
        )


def load_checked(name: str, root: str | os.PathLike = "candidates") -> dict:
    """:func:`load_candidate` + :func:`check_restorable`, with the candidate's ``spec`` (a path
    relative to the directory above ``root``, or absolute) made absolute and loaded once
    (``bench.load_spec``), so a malformed spec is refused now, not after the HOLD. Raises
    CandidateError, or ``bench.BenchError`` for the spec."""
    doc = load_candidate(name, root)
    check_restorable(doc)
    if doc.get("spec"):
        spec_path = Path(doc["spec"])
        if not spec_path.is_absolute():
            spec_path = Path(root).resolve().parent / spec_path
        doc["spec"] = str(spec_path)
        bench.load_spec(doc["spec"])
    return doc
