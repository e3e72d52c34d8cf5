"""The controller-side wheelhouse for offline installs (``dsv41_package_install_method: wheelhouse``).

An air-gapped host installs with ``pip install --no-index --find-links WHEELHOUSE -c constraints``.
The controller prepares, per target platform and Python, one directory holding:

- a binary wheel of every pinned dependency the host-side requirement set needs (pyproject's
  ``dependencies`` plus the host's extras; never the ``dev`` extra), resolved by ``pip download``
  against ``constraints.txt`` (torch's local ``+cpu`` tag dropped where the host takes its own torch);
- the build requirements of the project itself (pyproject's ``[build-system] requires``), so the
  host can build the native extensions (``dsv41.transport._fastrow``, ``dsv41.overlay._core``) for its own
  architecture without a registry;
- ``dsv41-<version>.tar.gz``: the project source (reproducible tar: sorted, fixed mtime, owner 0);
- ``constraints-host.txt`` and ``manifest.json`` (key, inputs, every file's sha256 and size).

The directory is named by :func:`cache_key` (sha256 over constraints.txt, the project version, the
source tree, the platform/Python and the requirement set), so a second deploy with the same inputs
reuses it without running pip. Run as ``python -m dsv41.wheelhouse build|check ...``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

#: Files of the project that make its source distribution (the same set the ``source`` install ships).
SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md", "constraints.txt")
SOURCE_DIRS = ("python",)
_SKIP = re.compile(r"(__pycache__|\.so$|\.pyc$|\.egg-info)")
#: Fixed mtime of every member of the source tarball (2026-01-01T00:00:00Z): reproducible bytes.
SOURCE_MTIME = 1767225600
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503 normalized project name (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Target:
    """The host a wheelhouse is for: pip's ``--platform`` tags, ``--python-version`` (``3.11``),
    ``--implementation`` (``cp``) and ``--abi`` (``cp311``)."""

    platforms: tuple[str, ...]
    python_version: str
    implementation: str = "cp"

    @property
    def abi(self) -> str:
        """The CPython ABI tag, e.g. ``cp311`` for ``3.11``."""
        return self.implementation + self.python_version.replace(".", "")

    @classmethod
    def for_host(cls, machine: str, python_version: str, glibc: str) -> Target:
        """The manylinux tags a host with ``machine`` (``x86_64``/``aarch64``), CPython
        ``python_version`` (``3.11``) and glibc ``glibc`` (``2.36``) accepts (PEP 600: every
        ``manylinux_2_Y`` with Y <= the host's glibc minor, newest first, back to 2_17).

        Raises ConfigError on a malformed version or machine."""
        if not re.fullmatch(r"3\.\d+", python_version):
            raise ConfigError(f"wheelhouse: python version {python_version!r} is not 3.N")
        m = re.fullmatch(r"2\.(\d+)", glibc)
        if not m or not re.fullmatch(r"[a-z0-9_]+", machine):
            raise ConfigError(f"wheelhouse: bad host platform (machine {machine!r}, glibc {glibc!r})")
        minor = int(m.group(1))
        tags = [f"manylinux_2_{y}_{machine}" for y in range(minor, 16, -1)]
        tags += [f"manylinux2014_{machine}", f"linux_{machine}"]
        return cls(tuple(tags), python_version)


def host_requirements(pyproject: dict, extras: list[str]) -> list[str]:
    """The host-side requirement strings: ``project.dependencies`` plus each named extra.

    ``extras`` must name extras of ``project.optional-dependencies``; ``dev`` is refused (hosts do
    not get the test and lint tools). Raises ConfigError naming an unknown or refused extra."""
    project = pyproject.get("project", {})
    optional = project.get("optional-dependencies", {})
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        if extra == "dev":
            raise ConfigError("wheelhouse: the dev extra is controller-only, not for hosts")
        if extra not in optional:
            raise ConfigError(f"wheelhouse: no extra {extra!r} in pyproject.toml (have {sorted(optional)})")
        reqs += optional[extra]
    return reqs


def build_requirements(pyproject: dict) -> list[str]:
    """``[build-system] requires`` plus ``wheel`` (setuptools' legacy build path asks for it)."""
    reqs = list(pyproject.get("build-system", {}).get("requires", []))
    if not any(canonical(_NAME.match(r).group(1)) == "wheel" for r in reqs):
        reqs.append("wheel")
    return reqs


def host_constraints(text: str, drop: tuple[str, ...] = ()) -> str:
    """constraints.txt for hosts: lines pinning a project in ``drop`` (canonical names) removed."""
    out = []
    for line in text.splitlines():
        m = _NAME.match(line)
        if m and not line.lstrip().startswith("#") and canonical(m.group(1)) in drop:
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def source_files(project_dir: Path) -> list[Path]:
    """The project files that go into the source tarball, sorted, relative to ``project_dir``."""
    files = [Path(f) for f in SOURCE_FILES]
    for d in SOURCE_DIRS:
        files += sorted(
            p.relative_to(project_dir) for p in (project_dir / d).rglob("*") if p.is_file() and not _SKIP.search(str(p))
        )
    return files


def source_tarball(project_dir: Path, version: str) -> bytes:
    """A reproducible ``dsv41-<version>.tar.gz`` of :func:`source_files` (top dir ``dsv41-<version>``)."""
    buf = io.BytesIO()
    # gzip mtime 0 and member mtimes fixed: the same tree gives the same bytes.
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for rel in source_files(project_dir):
            data = fileio.read_bytes(project_dir / rel, "project source")
            info = tarfile.TarInfo(f"dsv41-{version}/{rel.as_posix()}")
            info.size, info.mtime, info.mode = len(data), SOURCE_MTIME, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def cache_key(constraints: str, version: str, source: bytes, target: Target, requirements: list[str]) -> str:
    """16 hex chars of sha256 over every input that changes the wheelhouse's content."""
    h = hashlib.sha256()
    for part in (
        constraints,
        version,
        hashlib.sha256(source).hexdigest(),
        fileio.dumps_json(target.platforms),
        target.python_version,
        target.implementation,
        fileio.dumps_json(sorted(requirements)),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with fileio.open_input(path, "wheelhouse file") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel_project(filename: str) -> str:
    return canonical(filename.split("-", 1)[0])


def _pip_download(
    pip: list[str], dest: Path, constraints: Path, target: Target, reqs: list[str], index_args: list[str], no_deps: bool
) -> None:
    argv = [
        *pip,
        "download",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        "-c",
        str(constraints),
        "--python-version",
        target.python_version,
        "--implementation",
        target.implementation,
        "--abi",
        target.abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
    ]
    for p in target.platforms:
        argv += ["--platform", p]
    argv += [*index_args, *(["--no-deps"] if no_deps else []), *reqs]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise Dsv41Error(
            f"wheelhouse: pip download failed: {pip_failure(proc.stdout + proc.stderr) or 'rc ' + str(proc.returncode)}"
        )


def pip_failure(stderr: str) -> str:
    """One line from pip's stderr naming what failed: the requirement no wheel satisfies, else the
    pins in conflict (pip's "The user requested (constraint) X" lines), else its last ERROR line."""
    lines = [ln.strip() for ln in stderr.splitlines()]
    for ln in lines:
        if ln.startswith("ERROR: No matching distribution found for"):
            return ln.removeprefix("ERROR: ")
    pins = [
        ln.removeprefix("The user requested (constraint) ")
        for ln in lines
        if ln.startswith("The user requested (constraint)")
    ]
    if pins:
        return "no wheel satisfies the pinned " + ", ".join(pins) + " (conflicting dependencies)"
    errs = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:]
    return errs[-1].removeprefix("ERROR: ") if errs else ""


def build(
    project_dir: Path,
    cache_dir: Path,
    target: Target,
    extras: list[str],
    *,
    drop_pins: tuple[str, ...] = (),
    add: list[str] | None = None,
    no_deps: list[str] | None = None,
    index_args: list[str] | None = None,
    pip: list[str] | None = None,
    log=print,
) -> tuple[Path, bool]:
    """Build (or reuse) the wheelhouse for ``target`` under ``cache_dir/<key>``.

    ``extras``: host extras (:func:`host_requirements`); ``drop_pins``: canonical names whose pin is
    left out of the host constraints and the requirement set; ``add``: requirements downloaded in
    their place (``torch==2.13.0``: PyPI's CUDA build instead of the pinned ``+cpu``); ``no_deps``: extra requirements downloaded without their dependencies (nixl-cu12);
    ``index_args``: pip index options (default: pip's own configuration). Prints one progress line
    per step through ``log``. Returns ``(path, reused)``. Raises ConfigError/Dsv41Error with one line.
    """
    pip = pip or [sys.executable, "-m", "pip"]
    pyproject = tomllib.loads(fileio.read_text(project_dir / "pyproject.toml", "pyproject.toml"))
    version = pyproject["project"]["version"]
    constraints = fileio.read_text(project_dir / "constraints.txt", "constraints.txt")
    reqs = [
        r
        for r in host_requirements(pyproject, extras) + build_requirements(pyproject)
        if canonical(_NAME.match(r).group(1)) not in drop_pins
    ] + list(add or [])
    source = source_tarball(project_dir, version)
    key = cache_key(constraints, version, source, target, reqs + sorted(no_deps or []) + sorted(drop_pins))
    final = cache_dir / key
    if (final / "manifest.json").exists():
        check(final)
        log(f"wheelhouse: reusing {final}")
        return final, True
    t0 = time.monotonic()
    stage = cache_dir / f".{key}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    fileio.atomic_write(stage / "constraints-host.txt", host_constraints(constraints, drop_pins), "host constraints")
    log(
        f"wheelhouse: downloading {len(reqs)} requirements and their pinned dependencies for "
        f"{target.abi} {target.platforms[0]} ..."
    )
    _pip_download(pip, stage, stage / "constraints-host.txt", target, reqs, index_args or [], False)
    if no_deps:
        log(f"wheelhouse: downloading {', '.join(no_deps)} (no dependencies) ...")
        _pip_download(pip, stage, stage / "constraints-host.txt", target, no_deps, index_args or [], True)
    fileio.atomic_write(stage / f"dsv41-{version}.tar.gz", source, "source tarball")
    files = {p.name: {"sha256": _sha256(p), "size": p.stat().st_size} for p in sorted(stage.iterdir()) if p.is_file()}
    manifest = {
        "key": key,
        "version": version,
        "python": target.python_version,
        "abi": target.abi,
        "platforms": list(target.platforms),
        "requirements": reqs + list(no_deps or []),
        "source": f"dsv41-{version}.tar.gz",
        "files": files,
        "projects": sorted({_wheel_project(n) for n in files if n.endswith(".whl")}),
    }
    fileio.atomic_write_json(stage / "manifest.json", manifest, "wheelhouse manifest")
    shutil.rmtree(final, ignore_errors=True)
    stage.rename(final)
    size = sum(f["size"] for f in files.values())
    log(f"wheelhouse: built {final}: {len(files)} files, {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s")
    return final, False


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


def read_pins(text: str, what: str) -> list[str]:
    """The requirements of a fully pinned list (one ``name==version`` a line; ``#`` comments and
    blank lines ignored), in file order. Raises ConfigError naming the first line that is not an
    exact pin (a range, a URL, an option): every wheel of a pinned image is named by version."""
    pins = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not _PIN.match(line):
            raise ConfigError(f"wheelhouse: {what} line {n}: {line!r} is not an exact pin (name==version)")
        pins.append(line)
    if not pins:
        raise ConfigError(f"wheelhouse: {what} pins nothing")
    return pins


def pinned(
    requirements: Path,
    cache_dir: Path,
    target: Target,
    *,
    index_args: list[str] | None = None,
    pip: list[str] | None = None,
    log=print,
) -> tuple[Path, bool]:
    """Download (or reuse) the wheels of a fully pinned list, each with ``--no-deps`` (the list is
    the whole closure), for ``target`` under ``cache_dir/pinned-<key>``; the key covers the list's
    pins and the target. The directory holds the wheels, ``requirements.txt`` (the pins) and
    ``manifest.json`` (as :func:`build`'s, ``source`` empty). Returns ``(path, reused)``. Raises
    ConfigError/Dsv41Error with one line."""
    pip = pip or [sys.executable, "-m", "pip"]
    pins = read_pins(fileio.read_text(requirements, "pinned requirements"), str(requirements))
    key = "pinned-" + cache_key("\n".join(pins), "", b"", target, [])
    final = cache_dir / key
    if (final / "manifest.json").exists():
        check(final)
        log(f"wheelhouse: reusing {final}")
        return final, True
    t0 = time.monotonic()
    stage = cache_dir / f".{key}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    fileio.atomic_write(stage / "requirements.txt", "\n".join(pins) + "\n", "pinned requirements")
    fileio.atomic_write(stage / "constraints-host.txt", "\n".join(pins) + "\n", "host constraints")
    log(
        f"wheelhouse: downloading {len(pins)} pinned wheels (no dependencies) for {target.abi} {target.platforms[0]} ..."
    )
    _pip_download(pip, stage, stage / "constraints-host.txt", target, pins, index_args or [], True)
    files = {p.name: {"sha256": _sha256(p), "size": p.stat().st_size} for p in sorted(stage.iterdir()) if p.is_file()}
    manifest = {
        "key": key,
        "version": "",
        "python": target.python_version,
        "abi": target.abi,
        "platforms": list(target.platforms),
        "requirements": pins,
        "source": "",
        "files": files,
        "projects": sorted({_wheel_project(n) for n in files if n.endswith(".whl")}),
    }
    fileio.atomic_write_json(stage / "manifest.json", manifest, "wheelhouse manifest")
    shutil.rmtree(final, ignore_errors=True)
    stage.rename(final)
    size = sum(f["size"] for f in files.values())
    log(f"wheelhouse: built {final}: {len(files)} files, {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s")
    return final, False


def check(path: Path) -> dict:
    """Verify a wheelhouse against its manifest: every requirement has a wheel, every file is present
    with its recorded sha256. Returns the manifest. Raises VerificationError naming the first
    missing requirement or file."""
    manifest = fileio.read_json(path / "manifest.json", "wheelhouse manifest")
    present = {p.name for p in path.iterdir() if p.is_file()}
    have = {_wheel_project(n) for n in present if n.endswith(".whl")}
    for req in manifest["requirements"]:
        name = canonical(_NAME.match(req).group(1))
        if name not in have:
            raise VerificationError(f"wheelhouse {path}: no wheel for requirement {req}")
    for name, meta in manifest["files"].items():
        if name not in present:
            what = f"requirement {_wheel_project(name)}" if name.endswith(".whl") else "file"
            raise VerificationError(f"wheelhouse {path}: missing {name} ({what})")
        if _sha256(path / name) != meta["sha256"]:
            raise VerificationError(f"wheelhouse {path}: {name} differs from its manifest sha256")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """CLI: ``build`` (the project's wheelhouse) and ``pinned`` (a fully pinned list, no
    dependencies) print progress then one JSON line ``{"path", "reused", "key", "source",
    "digest"}``; ``check PATH`` verifies. Bad input: one ``error:`` line on stderr, exit 1/2."""
    ap = argparse.ArgumentParser(prog="python -m dsv41.wheelhouse")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--project-dir", type=Path, required=True)
    b.add_argument("--cache-dir", type=Path, required=True)
    b.add_argument("--machine", required=True)
    b.add_argument("--python-version", required=True)
    b.add_argument("--glibc", required=True)
    b.add_argument("--extra", action="append", default=[])
    b.add_argument("--drop-pin", action="append", default=[])
    b.add_argument("--add", action="append", default=[])
    b.add_argument("--no-deps", action="append", default=[])
    p = sub.add_parser("pinned")
    p.add_argument("--requirements", type=Path, required=True)
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--python-version", required=True)
    p.add_argument("--glibc", required=True)
    c = sub.add_parser("check")
    c.add_argument("path", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            m = check(args.path)
            print(fileio.dumps_json({"path": str(args.path), "key": m["key"], "files": len(m["files"])}))
            return 0
        target = Target.for_host(args.machine, args.python_version, args.glibc)
        log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
        if args.cmd == "pinned":
            path, reused = pinned(args.requirements, args.cache_dir, target, log=log)
        else:
            path, reused = build(
                args.project_dir,
                args.cache_dir,
                target,
                args.extra,
                drop_pins=tuple(canonical(n) for n in args.drop_pin),
                add=args.add,
                no_deps=args.no_deps,
                log=log,
            )
        m = fileio.read_json(path / "manifest.json", "wheelhouse manifest")
        digest = hashlib.sha256(fileio.dumps_json(m["files"], sort_keys=True).encode()).hexdigest()
        print(
            fileio.dumps_json(
                {"path": str(path), "reused": reused, "key": m["key"], "source": m["source"], "digest": digest}
            )
        )
        return 0
    except Dsv41Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"error: wheelhouse: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
