"""Speculative drafting: the DSpark-shaped drafter, its wire protocol and worker, the Spark-side
speculators (local, remote, async via the torch-free proxy) and the depth policy.

Torch is imported lazily: ``protocol``, ``shm``, ``policy`` and ``proxy`` run without it.
"""
