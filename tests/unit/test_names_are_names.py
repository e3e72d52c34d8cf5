"""Names are names: every `dsv41` command option or argument that takes a window, package,
candidate, drill or operation id (enumerated from the CLI's own definitions by parameter name)
refuses a glob, a path component or '..' with one line and a non-zero exit, before anything runs;
and the library functions that turn ids into paths refuse them too."""

from __future__ import annotations

import re

import pytest
import typer

from dsv41 import cli, names

#: Parameter names that carry an id of a window, package, candidate, drill report or operation.
ID_PARAM = re.compile(r"(^|_)(id|window|candidate|candidates|name|ref|control|op|a|b)$")
#: Parameters matching ID_PARAM that are not such ids, and why.
NOT_IDS = {
    ("env unit", "name"): "a systemd unit name, checked by dsv41.entrypoints.env_cli",
    ("engine serve", "served_model_name"): "the model id the API serves, not a file or directory name",
    ("window run", "control"): "a base URL",
    ("window run", "candidate"): "a base URL",
    ("oplock acquire", "op"): "one of oplock.OPERATIONS (checked)",
}
HOSTILE = ["*", "../x", "a/b", "..", "w[1]", "a?b", "/etc/passwd", " "]


def _commands():
    cli._register()
    root = typer.main.get_command(cli.app)

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for n, c in cmd.commands.items():
                yield from walk(c, path + [n])
        else:
            yield path, cmd

    yield from walk(root, [])


def _id_params():
    out = []
    for path, cmd in _commands():
        for p in cmd.params:
            if p.name and ID_PARAM.search(p.name) and (" ".join(path), p.name) not in NOT_IDS:
                out.append((path, p))
    return out


def test_the_class_is_found():
    found = {(" ".join(path), p.name) for path, p in _id_params()}
    assert {
        ("window stop-run", "window_id"),
        ("window candidate", "name"),
        ("window plan", "candidates"),
        ("package show", "ref"),
        ("oplock acquire", "op_id"),
        ("drill run", "drill_id"),
    } <= found


@pytest.mark.parametrize(
    "path,param",
    _id_params(),
    ids=lambda x: x if isinstance(x, str) else (" ".join(x) if isinstance(x, list) else x.name),
)
def test_every_id_refuses_globs_and_paths(path, param, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in HOSTILE:
        if param.param_type_name == "argument":
            args = path + [bad] + (["x" * 8] if param.name == "a" else [])
            if param.name == "b":
                args = path + ["0" * 8, bad]
        else:
            args = path + [param.opts[0], bad]
        rc = cli.main(args)  # the `dsv41` command's own entry point, in process
        err = capsys.readouterr().err
        assert rc != 0, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)


def test_library_functions_refuse_them(tmp_path):
    from dsv41.harness import candidates, win2, win2_cap, window_pid
    from dsv41.harness.window import WindowError

    for bad in HOSTILE:
        with pytest.raises(names.NameError_):
            names.check_name(bad)
        with pytest.raises(WindowError):
            window_pid.stop_runs(tmp_path, bad)
        with pytest.raises(WindowError):
            candidates.load_candidate(bad, tmp_path)
        with pytest.raises(win2.Win2Error):
            win2_cap.record_window(str(tmp_path), "aa", "tok_s", bad, "WIN")
