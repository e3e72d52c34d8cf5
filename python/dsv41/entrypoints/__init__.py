"""Composition roots: the only modules that import both the engine and the drafter.

``engine_serve`` builds ``dsv41 engine serve`` (engine + row source + speculator + HTTP server).
"""
