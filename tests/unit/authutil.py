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


#: vLLM 0.33's dev-mode routes (VLLM_SERVER_DEV_MODE=1): the fence must guard the ones that change
#: state too (it forwards every other path to vLLM).
VLLM_DEV_ROUTES = (
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/collective_rpc",
    "/scale_elastic_ep",
    "/is_sleeping",
)
#: The reads (vLLM's GET routes) among the fence's control routes and vLLM's dev routes.
VLLM_READ_ROUTES = frozenset({"/is_paused", "/is_sleeping"})


def app_routes(routes, prefix=""):
    """Every endpoint route of a Starlette/FastAPI route list as ``(route, full path)``, through
    included routers (FastAPI's ``_IncludedRouter`` too)."""
    for r in routes:
        if getattr(r, "methods", None):
            yield r, prefix + r.path
        inner = getattr(r, "original_router", None) or getattr(r, "router", None)
        if inner is not None and inner is not r:
            yield from app_routes(inner.routes, prefix + (getattr(r, "prefix", "") or ""))


def engine_control_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route of ``app`` that is not a read or inference
    (``dsv41.authz.is_control``), sorted."""
    from dsv41.authz import is_control

    return sorted({(m, path) for r, path in app_routes(app.routes) for m in r.methods if is_control(m, path)})


def engine_read_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route of ``app`` that only reads (a safe method outside inference:
    ``/health``, ``/is_paused`` ...), sorted."""
    from dsv41.authz import SAFE_METHODS, is_inference

    return sorted(
        {
            (m, path)
            for r, path in app_routes(app.routes)
            for m in r.methods
            if m in SAFE_METHODS and not is_inference(path)
        }
    )


def fence_control_paths() -> list[str]:
    """The paths the vLLM fence guards as control routes (POST): its own ``CONTROL_ROUTES`` and
    vLLM's dev routes, less the reads (:data:`VLLM_READ_ROUTES`)."""
    from dsv41.overlay.fence import CONTROL_ROUTES

    return sorted((CONTROL_ROUTES | set(VLLM_DEV_ROUTES)) - VLLM_READ_ROUTES)
