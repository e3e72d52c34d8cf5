"""Engram core: layout, hashing, table files, manifest, local row reader, row sources.

Facts and formulas: ``docs/engram.md`` and ``docs/engram-spec.md``.  Heavy modules
(torch) are imported lazily so the table server stays torch-free.
"""
