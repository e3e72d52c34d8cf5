"""Helpers for tests that read a row server's counters, and scripted row servers (a hung one, a
slow one) for the client's timeout and deadline paths."""

from __future__ import annotations

import socket
import threading
import time

from dsv41.transport import protocol as P


def settled_snapshot(srv, quiet_s: float = 0.05, limit_s: float = 3.0) -> dict:
    """The server's counters once they stop moving: the server counts a request after its reply
    is sent (the latency it records includes the send), so a client can read its answer a moment
    before the count moves."""
    end = time.monotonic() + limit_s
    last = srv.snapshot()
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = srv.snapshot()
        if now == last:
            return now
        last = now
    return last


class SilentServer:
    """Answers HELLO with the real table list, never answers a lookup (a hung server)."""

    def __init__(self, tables):
        self.hello = b"".join(P.TABLE_ENTRY.pack(t.identity, t.layer_id, t.rows, 264) for t in tables)
        self.n = len(tables)
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(4)
        self.port = self.ls.getsockname()[1]
        self.conns = []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self.conn, args=(c,), daemon=True).start()

    def conn(self, c):
        try:
            while True:
                h = b""
                while len(h) < P.REQ.size:
                    k = c.recv(P.REQ.size - len(h))
                    if not k:
                        return
                    h += k
                _, ver, op, rid, ident, count, plen = P.REQ.unpack(h)
                payload = b""
                while len(payload) < plen:
                    k = c.recv(plen - len(payload))
                    if not k:
                        return
                    payload += k
                if op == P.OP_HELLO:  # replies echo the request's version, as the real server's
                    c.sendall(P.REP.pack(P.MAGIC, ver, 0, rid, self.n, len(self.hello)) + self.hello)
                elif op == P.OP_LOOKUP:
                    self.lookup(c, ver, rid, ident, count, payload)
        except OSError:
            pass

    def lookup(self, c, ver, rid, ident, count, payload):
        """A hung server never answers a lookup."""

    def close(self):
        self.ls.close()
        for c in self.conns:
            c.close()


class SlowServer(SilentServer):
    """Answers HELLO at once and each LOOKUP with the exact rows (``reader.read(layer, ids)``)
    after ``delay_s`` per request, one request after another (a slow server)."""

    def __init__(self, tables, reader, delay_s):
        self.reader, self.delay_s = reader, delay_s
        self.layers = {t.identity: t.layer_id for t in tables}
        super().__init__(tables)

    def lookup(self, c, ver, rid, ident, count, payload):
        import numpy as np

        rows = self.reader.read(self.layers[ident], np.frombuffer(payload, "<u8").astype(np.int64))
        time.sleep(self.delay_s)
        c.sendall(P.REP.pack(P.MAGIC, ver, 0, rid, count, count * P.ROW_BYTES) + rows.tobytes())
