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
from dsv41.names import check_name
from dsv41.harness import bench
from dsv41.harness.window import WindowError

CANDIDATE_SCHEMA = Path(__file__).resolve().parents[1] / "schemas" / "candidate.schema.json"
#: Candidate role settings ``(role, key)`` -> the role variable that templates them (re-running
#: the role with production's values restores the file byte for byte; nothing else may be
#: changed). Every ``roles.<role>.<key>`` the schema admits has an entry.
ROLE_VARS = {("serve", "env"): "serve_extra_env", ("engram_server", "env"): "engram_server_extra_env",
             ("spec_decode", "async"): "spec_decode_async", ("spec_decode", "k"): "spec_decode_k",
             ("spec_decode", "timeout_ms"): "spec_decode_timeout_ms"}
#: Variables the roles derive from production's own files (digests, paths): a candidate that set
#: them would change what production's inputs are said to be, not a setting; refused.
DERIVED_ENV = frozenset({"DSV41_SERVE_INPUTS_SHA256", "DSV41_TABLES_MANIFEST", "DSV41_TABLES_MANIFEST_SHA256",
                         "DSV41_DRAFTER_FILES_SHA256", "DSV41_WINDOW_TOKEN"})


class CandidateError(WindowError):
    """A candidate file that is unknown, unreadable, off its schema or not restorable."""


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
        for name in sorted((settings.get("env") or {})):
            if name not in envs.ENV_VARS:
                raise CandidateError(f"candidate {doc['name']!r}: {role} env {name} is not a dsv41 variable "
                                     f"(python/dsv41/envs.py); the window cannot restore what no role templates")
            if name in DERIVED_ENV:
                raise CandidateError(f"candidate {doc['name']!r}: {role} env {name} is derived by the role from "
                                     f"production's files; a window may not set it")


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
