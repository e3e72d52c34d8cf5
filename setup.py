"""Build hook for the compiled part of dsv41 (metadata lives in pyproject.toml).

``pip install -e .`` (or ``pip install .``) compiles ``dsv41.transport._fastrow``, the C++ hot
path of the row transport, with pybind11's setuptools helpers.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "dsv41.transport._fastrow",
            ["python/dsv41/transport/_fastrow.cpp"],
            cxx_std=17,
            extra_compile_args=["-O2"],
            libraries=["dl"],  # dlopen of libcuda.so.1 (the overlay worker core)
        )
    ],
    cmdclass={"build_ext": build_ext},
)
