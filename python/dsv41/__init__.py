"""dsv41: the package every host of the dsv41-offload stack runs.

Subpackages: ``engram`` (layout, hashing, tables, manifest, server, client), ``transport``
(tcp and nixl request/response), ``engine`` (the local stand-in for the serving image),
``drafter`` (remote drafter worker, speculator, async proxy), ``overlay``, ``harness``,
``promotion`` and ``cli``.
"""

__version__ = "0.1.0"
