"""Files that are not files (issue 25 items 4 and 5): ``dsv41.fileio`` and everything that reads or
writes through it.

Classes and their members, each enumerated from the code where the code defines them:

* every path-typed parameter of every command (the command tree) given a FIFO, a character device,
  a socket and a dangling symlink: one line naming the option, exit 2, nothing opened (a FIFO would
  hang the reader: the whole batch runs in one child process under a timeout);
* every file type an input can be (FIFO, socket, device, directory, dangling symlink, a file that
  changes while read) against the reader, and every one an output path can be (plus a symlink)
  against the writers (atomic write, staged write, path for third-party writers, append): refused,
  and the thing at the path left exactly as it was;
* every write failure: ENOSPC on a small tmpfs mounted here (root) for the atomic writer, the
  appender and a real command's ``--out``; ENOSPC and EPIPE on stdout (``/dev/full``, a closed pipe);
* state that depends on a write: a window's decision and its two-window cap are kept together;
* no module of the package opens a file for reading or writing except through ``fileio``: the scan
  is test_fileio_sites.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsv41 import fileio
from dsv41.errors import Dsv41Error

PKG = Path(__file__).resolve().parents[2] / "python" / "dsv41"
REPO = PKG.parents[1]


@pytest.fixture
def odd(tmp_path: Path) -> dict[str, Path]:
    """One of each file type that is not a regular file, plus a regular file and a symlink to it."""
    d = tmp_path / "odd"
    d.mkdir()
    os.mkfifo(d / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "sock"))
    (d / "dir").mkdir()
    (d / "regular").write_text('{"a": 1}\n')
    os.symlink(d / "nowhere", d / "dangling")
    os.symlink(d / "regular", d / "link")
    yield {
        "fifo": d / "fifo",
        "socket": d / "sock",
        "device": Path("/dev/null"),
        "directory": d / "dir",
        "dangling": d / "dangling",
        "regular": d / "regular",
        "link": d / "link",
    }
    s.close()


def _snapshot(p: Path):
    st = os.lstat(p)
    data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
    return stat.S_IFMT(st.st_mode), st.st_ino, data, os.readlink(p) if stat.S_ISLNK(st.st_mode) else None


def _leftovers(d: Path) -> list[str]:
    return [n for n in os.listdir(d) if n.endswith(".tmp")]


# ---- inputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,msg",
    [
        ("fifo", "is a FIFO"),
        ("socket", "is a socket"),
        ("device", "is a character device"),
        ("directory", "is a directory"),
        ("dangling", "dangling symlink"),
    ],
)
def test_reader_refuses_what_is_not_a_regular_file(odd, kind, msg) -> None:
    for read in (fileio.read_bytes, fileio.read_text, fileio.read_json, fileio.check_input):
        with pytest.raises(fileio.FileError, match=msg) as e:
            read(odd[kind], "--input")
        assert str(e.value).startswith(f"cannot read --input {odd[kind]}")
    assert fileio.read_json(odd["link"]) == {"a": 1}  # a symlink to a regular file is that file


def test_reader_refuses_a_file_that_changes_while_read(tmp_path: Path) -> None:
    p = tmp_path / "growing.jsonl"
    p.write_bytes(b"x" * 100)
    with pytest.raises(fileio.FileError, match="changed while it was read"):
        with fileio.open_input(p, "cells file") as f:
            f.read(10)
            with open(p, "ab") as w:  # a writer still appending
                w.write(b"more")
    with pytest.raises(fileio.FileError, match="changed while it was read"):
        with fileio.open_input(p) as f:
            f.read()
            q = tmp_path / "new"
            q.write_bytes(b"y" * 104)
            os.replace(q, p)  # replaced by rename: same size, another inode
    with fileio.open_input(p) as f:
        assert f.read() == b"y" * 104
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(fileio.FileError, match="not UTF-8 text"):
        fileio.read_text(tmp_path / "bin")
    with pytest.raises(fileio.FileError, match="larger than 3 bytes"):
        fileio.read_bytes(p, max_bytes=3)


def test_a_fifo_swapped_in_after_the_check_does_not_block(tmp_path: Path, monkeypatch) -> None:
    """The open is O_NONBLOCK and fstat'ed: a FIFO put in place between stat and open is refused."""
    p = tmp_path / "f"
    p.write_text("{}")
    real = fileio.check_input

    def swap(path, what=None, *, error=None):
        st = real(path, what, error=error)
        os.unlink(path)
        os.mkfifo(path)
        return st

    monkeypatch.setattr(fileio, "check_input", swap)
    with pytest.raises(fileio.FileError, match="replaced while it was opened"):
        fileio.read_bytes(p)


# ---- outputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,msg",
    [
        ("fifo", "is a FIFO"),
        ("socket", "is a socket"),
        ("device", "is a character device"),
        ("directory", "is a directory"),
        ("dangling", "is a symlink"),
        ("link", "is a symlink"),
    ],
)
def test_writers_refuse_and_leave_what_is_at_the_path(odd, kind, msg) -> None:
    p = odd[kind]
    before = _snapshot(p)
    target = _snapshot(odd["regular"])
    writers = [
        lambda: fileio.atomic_write(p, b"new", "--out"),
        lambda: fileio.atomic_write_json(p, {"b": 2}, "--out"),
        lambda: fileio.stage(p, "new", "--out").commit(),
        lambda: fileio.append(p, "line\n", "--out"),
        lambda: fileio.Appender(p, "--out"),
    ]

    def third_party():
        with fileio.atomic_path(p, "--out") as tmp:
            tmp.write_bytes(b"new")

    for w in [*writers, third_party]:
        with pytest.raises(fileio.FileError, match=msg):
            w()
        assert _snapshot(p) == before and _snapshot(odd["regular"]) == target
        assert _leftovers(p.parent) == [] or p == Path("/dev/null")


def test_symlink_followed_only_when_asked_and_modes_kept(odd, tmp_path: Path) -> None:
    os.chmod(odd["regular"], 0o640)
    fileio.atomic_write(odd["link"], b"via link", follow_symlinks=True)
    assert os.path.islink(odd["link"]) and odd["regular"].read_bytes() == b"via link"
    assert stat.S_IMODE(os.stat(odd["regular"]).st_mode) == 0o640  # the replaced file's mode is kept
    fileio.atomic_write(tmp_path / "fresh", "x", mode=0o600)
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o600
    with pytest.raises(fileio.FileError, match="directory .* does not exist"):
        fileio.atomic_write(tmp_path / "no" / "such" / "x", "x")


def test_cli_follow_symlinks_option(tmp_path: Path, capsys) -> None:
    """``dsv41 --follow-symlinks``: a real command's output through a symlink (refused without it)."""
    from dsv41.cli import main

    real = tmp_path / "vars.json"
    real.write_text("old\n")
    link = tmp_path / "link.json"
    os.symlink(real, link)
    args = ["window", "candidate", "aa", "--root", str(REPO / "candidates"), "--vars-out", str(link)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "is a symlink" in err and real.read_text() == "old\n"
    assert main(["--follow-symlinks", *args]) == 0
    capsys.readouterr()
    assert os.path.islink(link) and isinstance(json.loads(real.read_text()), dict)
    assert main(args) == 1  # the option does not outlive its run
    capsys.readouterr()


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 64 KiB tmpfs mounted under tmp_path (unmounted at teardown); skipped without root."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d: Path) -> None:
    """Fill the file system of ``d`` to the last byte."""
    with open(d / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"f" * 4096)
                f.flush()
        except OSError:
            pass


def test_enospc_leaves_the_old_file_and_no_partial_one(small_fs: Path) -> None:
    old = small_fs / "state.json"
    old.write_text('{"old": true}\n')
    big = b"z" * (1 << 20)
    with pytest.raises(fileio.FileError, match="no space left on the device"):
        fileio.atomic_write(old, big, "--out")
    assert old.read_text() == '{"old": true}\n' and sorted(os.listdir(small_fs)) == ["state.json"]
    with pytest.raises(fileio.FileError, match="no space left"):
        fileio.atomic_write(small_fs / "absent.json", big)
    assert sorted(os.listdir(small_fs)) == ["state.json"]  # no empty or partial file either

    def save(tmp):
        tmp.write_bytes(big)  # a third-party writer (safetensors.save_file) filling its temp path

    with pytest.raises(fileio.FileError, match="no space left"):
        with fileio.atomic_path(small_fs / "weights.safetensors") as tmp:
            save(tmp)
    assert sorted(os.listdir(small_fs)) == ["state.json"]
    log = small_fs / "cells.jsonl"
    fileio.append(log, '{"cell": 1}\n')
    with pytest.raises(fileio.FileError, match="nothing was appended"):
        fileio.append(log, b"{" + big + b"}\n")
    assert log.read_text() == '{"cell": 1}\n'  # truncated back: no torn record


def test_enospc_through_a_real_command(small_fs: Path) -> None:
    """``dsv41 window candidate --vars-out`` on a full disk: one line, exit 1, old file kept."""
    _fill(small_fs)
    out = small_fs / "vars.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv41.cli",
            "window",
            "candidate",
            "aa",
            "--root",
            str(REPO / "candidates"),
            "--vars-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no space left" in r.stderr, r.stderr
    assert not out.exists() and _leftovers(small_fs) == []


def test_stdout_full_or_closed_gives_one_line() -> None:
    code = [sys.executable, "-m", "dsv41.cli", "engram", "layout", str(PKG / "data" / "lab_model.json")]
    with open("/dev/full", "w") as full:
        r = subprocess.run(code, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr == "dsv41: error: cannot write to stdout: no space left on the device\n"
    p = subprocess.Popen(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1
    assert err == "dsv41: error: cannot write to stdout: the reader closed the pipe\n"


# ---- the command line: every path parameter ---------------------------------------------------------


def test_every_path_parameter_refuses_fifo_socket_device_and_dangling_symlink(odd, tmp_path: Path) -> None:
    """All path-typed parameters of the command tree, each given each odd file, in one child
    process (a FIFO that got opened would hang it: the timeout turns that into a failure)."""
    driver = textwrap.dedent("""
        import io, json, sys, contextlib
        from typer.main import get_command
        from dsv41 import cli, errors
        cmd = get_command(cli.app)
        paths = json.loads(sys.argv[1])
        res = []
        for path, p in errors.iter_parameters(cmd):
            if not p.type_descriptor.is_path:
                continue
            for kind, value in paths.items():
                if p.param_type_name == "argument":
                    argv = [*path, value]
                else:
                    argv = [*path, max(o for o in p.opts if o.startswith("--")), value]
                err = io.StringIO()
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    rc = errors.run_app(cli.app, argv, command=cmd)
                res.append([argv, " ".join(path) + " " + errors.option_name(p), kind, rc, err.getvalue()])
        print(json.dumps(res))
    """)
    kinds = {k: str(odd[k]) for k in ("fifo", "socket", "device", "dangling")}
    r = subprocess.run(
        [sys.executable, "-c", driver, json.dumps(kinds)], capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    words = {
        "fifo": "is a FIFO",
        "socket": "is a socket",
        "device": "is a character device",
        "dangling": "is a dangling symlink",
    }
    params = {name for _, name, *_ in res}
    assert len(params) >= 30, params  # engram, engine, env, package, ... all have path parameters
    bad = [
        (a, rc, err)
        for a, name, kind, rc, err in res
        if not (rc == 2 and err.count("\n") == 1 and err.startswith(f"dsv41: error: {name}: ") and words[kind] in err)
    ]
    assert not bad, bad[:5]


@pytest.mark.parametrize(
    "argv_of",
    [
        lambda f: ["window", "decide", f],
        lambda f: ["window", "decide", "--gate", f, "/nonexistent"],
        lambda f: ["bench", "run", "--endpoint", "http://127.0.0.1:9", "--spec", f],
        lambda f: ["window", "simulate", "--from-cells", f],
    ],
)
def test_string_typed_inputs_refuse_a_fifo_in_the_reader(odd, argv_of, tmp_path: Path) -> None:
    """Inputs typed as plain strings reach the reader, which refuses the FIFO without opening it."""
    argv = argv_of(str(odd["fifo"]))
    r = subprocess.run(
        [sys.executable, "-m", "dsv41.cli", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "is a FIFO, not a regular file" in r.stderr, r.stderr


# ---- a window's decision and its two-window cap ---------------------------------------------------


def _decided_window():
    from dsv41.harness import bench, win2, window

    sp = bench.load_spec(env={})
    sp["blocks_per_prompt"] = 2
    cells = []
    for i, c in enumerate(window.plan_cells(sp, 1, "s")):
        res = bench.RequestResult(
            c["prompt_id"],
            c["category"],
            c["seed"],
            c["max_tokens"],
            ok=True,
            ttft_ms=50 + i % 3,
            step_ms_p50=20 + (i % 5) * 0.1,
            tok_s=50.0,
            tokens_per_step=1.5,
            steps=10,
            step_ms=[20.0] * 9,
            finish_reason="length",
            completion_tokens=14,
        )
        cells.append(window.cell_record(c, res))
    return win2.decide(cells, n_resamples=199), cells


def test_decision_and_cap_are_kept_together(tmp_path: Path) -> None:
    from dsv41.harness import win2_cap, window

    d, cells = _decided_window()
    state = tmp_path / "windows"
    state.mkdir()

    def cap(wid):
        return lambda: win2_cap.stage_window(str(state), "aa", d.metric, wid, d.verdict)

    # 1. the decision cannot be written: the cap is not consumed
    w1 = state / "w1"
    w1.mkdir()
    os.mkfifo(w1 / "decision.json")
    with pytest.raises(Dsv41Error, match="is a FIFO"):
        window.write_report(str(w1), d, cells, {"window_id": "w1"}, cap=cap("w1"))
    assert not (state / "questions.json").exists() and _leftovers(state) == [] and _leftovers(w1) == []
    assert win2_cap.check_cap(str(state), "aa", d.metric) == 1
    # 2. the cap cannot be written: no decision is kept either
    w2 = state / "w2"
    os.mkfifo(state / "questions.json")
    with pytest.raises(Dsv41Error, match="is a FIFO"):
        window.write_report(str(w2), d, cells, {"window_id": "w2"}, cap=cap("w2"))
    assert not (w2 / "decision.json").exists() and _leftovers(w2) == []
    os.unlink(state / "questions.json")
    # 3. both written: the window is counted and decided
    window.write_report(str(w2), d, cells, {"window_id": "w2"}, cap=cap("w2"))
    assert json.loads((w2 / "decision.json").read_text())["decision"]["verdict"] == d.verdict
    assert [w["window"] for w in json.loads((state / "questions.json").read_text())["aa:" + d.metric]] == ["w2"]


def test_decision_and_cap_on_a_full_disk(small_fs: Path) -> None:
    from dsv41.harness import win2_cap, window

    d, cells = _decided_window()
    (small_fs / "w1").mkdir()
    _fill(small_fs)
    with pytest.raises(Dsv41Error, match="no space left"):
        window.write_report(
            str(small_fs / "w1"),
            d,
            cells,
            {"window_id": "w1", "pad": "p" * 8192},
            cap=lambda: win2_cap.stage_window(str(small_fs), "aa", d.metric, "w1", d.verdict),
        )
    assert not (small_fs / "questions.json").exists() and not (small_fs / "w1" / "decision.json").exists()
    assert _leftovers(small_fs) == [] and _leftovers(small_fs / "w1") == []
