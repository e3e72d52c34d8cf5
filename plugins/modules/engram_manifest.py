#!/usr/bin/python
# -*- coding: utf-8 -*-
# Apache License 2.0
"""Ansible module: verify Engram shards against the trusted manifest (thin; dsv41.engram.manifest)."""
from __future__ import annotations

DOCUMENTATION = r"""
---
module: engram_manifest
short_description: Verify Engram table shards against a trusted dsv41 manifest
description:
  - Loads the manifest with C(dsv41.engram.manifest.load_manifest) (JSON Schema) and verifies the
    shards with C(dsv41.engram.manifest.verify) (sizes, chunked sha256, table identities).
  - Keeps a cache of verified files keyed by (size, mtime_ns, inode) and the manifest's sha256,
    so an unchanged shard is not rehashed on every run; a changed or new file is verified again.
  - A failure names the file and chunk (the message of C(VerificationError)).
options:
  manifest:
    description: Path of the manifest on the host.
    type: path
    required: true
  data_dir:
    description: Directory holding the shards named in the manifest.
    type: path
    required: true
  cache:
    description: Verification cache file; V("") disables the cache.
    type: path
    default: ""
  identities:
    description:
      - Expected table identity (hex sha256) per layer id; a manifest whose identities differ fails.
    type: dict
    default: {}
  workers:
    description: Hashing threads (default chosen by dsv41).
    type: int
attributes:
  check_mode:
    support: full
    description: Verifies (read-only) but does not write the cache.
  diff_mode:
    support: none
    description: Nothing is changed on the host except the cache, which is not diffed.
requirements:
  - the dsv41 Python package on the host (run with its venv as the interpreter)
author:
  - dsv41-offload (@dsv41)
"""

EXAMPLES = r"""
- name: Verify the shards
  engram_manifest:
    manifest: /opt/dsv41/tables/manifest.json
    data_dir: /opt/dsv41/tables
    cache: /opt/dsv41/tables/.verified.json
  vars:
    ansible_python_interpreter: /opt/dsv41/venv/bin/python
"""

RETURN = r"""
files:
  description: Shard files named by the manifest.
  returned: always
  type: list
  elements: str
verified:
  description: Files hashed in this run.
  returned: always
  type: list
  elements: str
cached:
  description: Files skipped because the cache entry matched (size, mtime_ns, inode, manifest).
  returned: always
  type: list
  elements: str
cache_updated:
  description: Whether the cache file was written.
  returned: always
  type: bool
tables:
  description: Layer id, file and identity of each table.
  returned: always
  type: list
  elements: dict
"""

import dataclasses
import hashlib
import json
import os
import tempfile

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import Dsv41Error, import_dsv41, require_dsv41
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import Dsv41Error, import_dsv41, require_dsv41

dsv41_manifest = import_dsv41("dsv41.engram.manifest")

CACHE_FORMAT = "dsv41-verify-cache/1"


def file_key(path):
    """(size, mtime_ns, inode) of ``path``; None if it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def load_cache(path, manifest_sha):
    """Cached {file: key} for this manifest; empty when absent, unreadable or for another manifest."""
    if not path:
        return {}
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("manifest_sha256") != manifest_sha:
        return {}
    files = doc.get("files")
    return files if isinstance(files, dict) else {}


def save_cache(module, path, manifest_sha, files):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".verify-cache.")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": CACHE_FORMAT, "manifest_sha256": manifest_sha, "files": files}, f, indent=1, sort_keys=True)
    module.atomic_move(tmp, path)


def subset(man, names):
    """The manifest restricted to the files called ``names`` (a dataclass copy; verify() walks
    ``files``), or the whole manifest when it is not a dataclass."""
    if dataclasses.is_dataclass(man) and any(f.name == "files" for f in dataclasses.fields(man)):
        return dataclasses.replace(man, files=[f for f in man.files if f["name"] in names])
    return man


def main():
    module = AnsibleModule(
        argument_spec=dict(
            manifest=dict(type="path", required=True),
            data_dir=dict(type="path", required=True),
            cache=dict(type="path", default=""),
            identities=dict(type="dict", default={}),
            workers=dict(type="int"),
        ),
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    try:
        with open(p["manifest"], "rb") as f:
            manifest_sha = hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        module.fail_json(msg="cannot read manifest %s: %s" % (p["manifest"], exc.strerror))
    try:
        man = dsv41_manifest.load_manifest(p["manifest"])
    except Dsv41Error as exc:
        module.fail_json(msg=str(exc), manifest=p["manifest"])
    tables = [dict(layer_id=t.layer_id, file=t.file, identity=t.identity) for t in man.tables]
    for layer, want in sorted(p["identities"].items()):
        have = [t["identity"] for t in tables if str(t["layer_id"]) == str(layer)]
        if have != [str(want)]:
            module.fail_json(msg="manifest %s: layer %s identity %s, expected %s" % (
                p["manifest"], layer, have[0] if have else "missing", want), tables=tables)
    files = sorted({f["name"] for f in man.files})
    cache = load_cache(p["cache"], manifest_sha)
    keys = {f: file_key(os.path.join(p["data_dir"], f)) for f in files}
    todo = [f for f in files if keys[f] is None or cache.get(f) != keys[f]]
    if todo:
        try:
            dsv41_manifest.verify(subset(man, set(todo)), p["data_dir"], workers=p["workers"], progress=False)
        except Dsv41Error as exc:
            module.fail_json(msg=str(exc), manifest=p["manifest"], data_dir=p["data_dir"], tables=tables)
    new_cache = {f: keys[f] for f in files}
    cache_updated = bool(p["cache"]) and new_cache != cache and not module.check_mode
    if cache_updated:
        save_cache(module, p["cache"], manifest_sha, new_cache)
    module.exit_json(changed=False, files=files, verified=todo, cached=[f for f in files if f not in todo],
                     cache_updated=cache_updated, tables=tables)


if __name__ == "__main__":
    main()
