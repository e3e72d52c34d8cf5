"""Servers under fuzz, each in its own process so its RSS can be sampled apart from the fuzzer.

``python fuzz_servers.py KIND [DIR]`` prints ``READY <json>`` (ports, identities) on stdout
and serves until stdin closes. KIND: ``tcp`` (the C++ row server), ``tcp-python`` (the pure
Python one), ``nixl`` (a row server with a ``nixl://`` control channel and a NIXL exporter),
``drafter`` (a drafter worker over a small random drafter written to DIR).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

DRAFTER_H, DRAFTER_V, DRAFTER_TARGET = 16, 40, "cd" * 32


def main() -> None:
    kind = sys.argv[1]
    if kind in ("tcp", "tcp-python", "nixl"):
        os.environ.setdefault("UCX_TLS", "tcp")
        from dsv41.transport import parse_url
        from dsv41.transport.server import RowServer
        from framefuzz import TABLE

        if kind == "nixl":
            from dsv41.transport.nixl_backend import NixlExporter

            ex = NixlExporter([TABLE])
            srv = RowServer([TABLE], [parse_url("nixl://127.0.0.1:0")], nixl_provider=ex)
        else:
            srv = RowServer([TABLE], [parse_url("tcp://127.0.0.1:0")], native=(kind == "tcp"))
        ep = srv.start()[0]
        print("READY " + json.dumps({"port": ep.port, "pid": os.getpid()}), flush=True)
        sys.stdin.read()
        print("STATS " + json.dumps(srv.snapshot(), default=str), flush=True)
        srv.stop(2)
    elif kind == "drafter":
        import torch

        from dsv41.drafter.model import TorchDrafter, random_drafter
        from dsv41.drafter.worker import DrafterWorker

        torch.set_num_threads(1)
        d = Path(sys.argv[2])
        random_drafter(
            d, vocab_size=DRAFTER_V, hidden_size=DRAFTER_H, seed=1, d_model=32, target_identity=DRAFTER_TARGET
        )
        w = DrafterWorker(TorchDrafter(d, max_batch=8), target_identity=DRAFTER_TARGET)
        host, port = w.start()
        print(
            "READY "
            + json.dumps(
                {
                    "port": port,
                    "pid": os.getpid(),
                    "drafter": w.hello.drafter_identity,
                    "markov": w.hello.markov_identity,
                }
            ),
            flush=True,
        )
        sys.stdin.read()
        w.stop()
    else:
        raise SystemExit(f"unknown kind {kind}")


if __name__ == "__main__":
    main()
