"""Build hook for the compiled parts of dsv41 (metadata lives in pyproject.toml).

``pip install -e .`` (or ``pip install .``) compiles, with pybind11's setuptools helpers:

- ``dsv41.transport._fastrow``: the C++ hot path of the row transport (server request loop,
  client lookups);
- ``dsv41.overlay._core``: the vLLM overlay's Engram worker core (slots, planner, GPU join,
  watchdog, CUDA driver shims), which sends its requests with the transport's client path.

Each extension is one translation unit (its ``.cpp``) that includes its headers; ``NATIVE``
lists every source and header of each, so a changed header rebuilds it (``depends``) and ships
in the sdist the hosts build from (the Makefile's NATIVE_SRC and the length cap read it too).
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

#: extension name -> its sources: the translation unit first, then the headers it includes
#: (paths relative to this file; headers are included as "dsv41/<package>/<name>.h" from python/).
NATIVE = {
    "dsv41.transport._fastrow": [
        "python/dsv41/transport/_fastrow.cpp",
        "python/dsv41/transport/wire.h",
        "python/dsv41/transport/client.h",
    ],
    "dsv41.overlay._core": [
        "python/dsv41/overlay/_core.cpp",
        "python/dsv41/overlay/core_engram.h",
        "python/dsv41/overlay/core_stream.h",
        "python/dsv41/overlay/core_jobs.h",
        "python/dsv41/overlay/core_plan.h",
        "python/dsv41/overlay/core_slot.h",
        "python/dsv41/overlay/core_local.h",
        "python/dsv41/overlay/core_driver.h",
        "python/dsv41/transport/wire.h",
        "python/dsv41/transport/client.h",
    ],
}
#: extra link libraries per extension: the core dlopens libcuda.so.1 (it links no CUDA library)
LIBRARIES = {"dsv41.overlay._core": ["dl"]}

if __name__ == "__main__":
    setup(
        ext_modules=[
            Pybind11Extension(
                name,
                files[:1],
                depends=files[1:],
                include_dirs=["python"],
                cxx_std=17,
                extra_compile_args=["-O2"],
                libraries=LIBRARIES.get(name, []),
            )
            for name, files in NATIVE.items()
        ],
        cmdclass={"build_ext": build_ext},
    )
