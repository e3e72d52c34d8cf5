#!/usr/bin/python
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
  - Keeps a cache of verified files (C(dsv41.engram.manifest.verify)'s) keyed by size, mtime_ns,
    ctime_ns, device and inode and by the manifest's content, so an unchanged shard is not
    rehashed on every run. A write to a shard changes its ctime, which a user cannot set back, so
    a changed file is verified again even when its mtime was restored.
  - O(verify=full) re-hashes every shard whatever the cache says (for a schedule, or after a
    suspicion the cache cannot see, such as corruption below the file system).
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
  verify:
    description:
      - V(cached) skips shards whose cache entry matches; V(full) re-hashes every shard and
        rewrites the cache.
    type: str
    choices: [cached, full]
    default: cached
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

- name: Re-hash every shard whatever the cache says (scheduled)
  engram_manifest:
    manifest: /opt/dsv41/tables/manifest.json
    data_dir: /opt/dsv41/tables
    cache: /opt/dsv41/tables/.verified.json
    verify: full
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
  description: Files skipped because the cache entry matched (size, mtime_ns, ctime_ns, device, inode, manifest).
  returned: always
  type: list
  elements: str
cache_updated:
  description: Whether the cache file was written.
  returned: always
  type: bool
verify:
  description: The verify mode used, V(cached) or V(full).
  returned: always
  type: str
tables:
  description: Layer id, file and identity of each table.
  returned: always
  type: list
  elements: dict
"""

from ansible.module_utils.basic import AnsibleModule

try:
    from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import (
        Dsv41Error,
        import_dsv41,
        require_dsv41,
    )
except ImportError:  # run from library/ (ansible.cfg: module_utils = plugins/module_utils)
    from ansible.module_utils.dsv41_common import Dsv41Error, import_dsv41, require_dsv41

dsv41_manifest = import_dsv41("dsv41.engram.manifest")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            manifest=dict(type="path", required=True),
            data_dir=dict(type="path", required=True),
            cache=dict(type="path", default=""),
            identities=dict(type="dict", default={}),
            workers=dict(type="int"),
            verify=dict(type="str", default="cached", choices=["cached", "full"]),
        ),
        supports_check_mode=True,
    )
    require_dsv41(module)
    p = module.params
    try:
        man = dsv41_manifest.load_manifest(p["manifest"])
    except Dsv41Error as exc:
        module.fail_json(msg=str(exc), manifest=p["manifest"])
    tables = [dict(layer_id=t.layer_id, file=t.file, identity=t.identity) for t in man.tables]
    for layer, want in sorted(p["identities"].items()):
        have = [t["identity"] for t in tables if str(t["layer_id"]) == str(layer)]
        if have != [str(want)]:
            module.fail_json(
                msg="manifest {}: layer {} identity {}, expected {}".format(
                    p["manifest"], layer, have[0] if have else "missing", want
                ),
                tables=tables,
            )
    try:
        report = dsv41_manifest.verify(
            man,
            p["data_dir"],
            workers=p["workers"],
            progress=False,
            cache=p["cache"] or None,
            mode=p["verify"],
            update_cache=not module.check_mode,
        )
    except Dsv41Error as exc:
        module.fail_json(msg=str(exc), manifest=p["manifest"], data_dir=p["data_dir"], tables=tables)
    module.exit_json(
        changed=False,
        files=sorted(report.files),
        verified=sorted(report.verified),
        cached=sorted(report.cached),
        cache_updated=report.cache_updated,
        verify=p["verify"],
        tables=tables,
    )


if __name__ == "__main__":
    main()
