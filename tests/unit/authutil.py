"""The operator credential of the unit tests' servers and clients (``dsv41.authz``): the
engines and fences built in tests take :data:`OPERATOR` and accept the test clients' host names
(:data:`TEST_HOSTS`); clients send :data:`OP_HEADERS` on control routes."""

from __future__ import annotations

from dsv41.authz import OPERATOR_HEADER

OPERATOR = "unit-test-operator-credential-0123456789"
#: Host names of the in-process test clients (Starlette's TestClient says ``testserver``).
TEST_HOSTS = ("testserver", "rank0", "engine")
OP_HEADERS = {OPERATOR_HEADER: OPERATOR}
#: create_app / AdmissionFence keyword arguments of a test server.
SERVER_AUTH = {"allowed_hosts": TEST_HOSTS}


def write_credential(path) -> str:
    """Write :data:`OPERATOR` to ``path`` with mode 0600; returns the path as a string."""
    from dsv41.authz import write_secret

    write_secret(path, OPERATOR)
    return str(path)
