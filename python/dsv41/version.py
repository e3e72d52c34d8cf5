"""What ``dsv41 version --json`` reports about this host's install (the dsv41_package role and
``playbooks/verify.yml`` read it instead of running Python snippets on the host)."""

from __future__ import annotations

import platform


def version_info() -> dict:
    """``{"dsv41": package version, "python": "X.Y.Z", "native": bool, "transport": "c++"|"python"}``.

    ``native`` is True when the C++ transport extension (``dsv41.transport._fastrow``) imports;
    ``transport`` is the path a default client/server uses (``dsv41.transport.native``).
    """
    from dsv41 import __version__
    from dsv41.transport import native

    return {
        "dsv41": __version__,
        "python": platform.python_version(),
        "native": native._fastrow is not None,
        "transport": native.implementation(),
    }
