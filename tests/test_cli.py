"""The ``torchlens`` command line, run as a user runs it: in a subprocess, with its real output checked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torchlens as tl
from torchlens.cli import main

MODELS = textwrap.dedent('''
    import torch, torch.nn as nn

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

        def forward(self, x, y, scale=1.0):
            return self.blocks(x + y) * scale

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(5, 2))

        def forward(self, x):
            return self.blocks(x)

    def build():
        return Pair()

    def needs_args(width):
        return nn.Linear(width, width)

    def as_function():
        return lambda x, y: torch.relu(x + y)

    INSTANCE = Pair()
    SIZE = 8
''')


@pytest.fixture()
def models(tmp_path):
    (tmp_path / "clitargets.py").write_text(MODELS)
    return tmp_path


def run(args, cwd, timeout=180):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd)] + sys.path))
    return subprocess.run([sys.executable, "-m", "torchlens", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_writes_its_folder_and_show_reads_it_back(tmp_path, capsys):
    done = run(["demo", "--out", "demo_out"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Trace of DemoNet" in done.stdout and "recurrent (up to 3 passes" in done.stdout
    assert "Hot path (duration" in done.stdout and "conv2d_2_4:" in done.stdout
    assert "Module calls (to depth 2)" in done.stdout and "block:3" in done.stdout
    saved = tmp_path / "demo_out" / "trace"
    assert (saved / "manifest.json").is_file()
    assert f"Demo outputs in {tmp_path / 'demo_out'}" in done.stdout
    assert main(["show", str(saved), "--depth", "1"]) == 0  # in this process: the folder is what crosses over
    shown = capsys.readouterr().out
    loaded = tl.load(saved)
    assert str(loaded) in shown and "  stem:1 " in shown and "  stem.0:1" not in shown


def test_trace_a_factory_with_two_inputs_kwargs_and_save(models):
    done = run(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--kwargs-json", '{"scale": 3.0}',
                "--save", "saved", "--hot-path", "2", "--depth", "1"], models)
    assert done.returncode == 0, done.stderr
    assert "tracing Pair on 2x8, 2x8 (float32)" in done.stderr and "wrote saved trace: saved" in done.stderr
    loaded = tl.load(models / "saved")
    assert "Trace of Pair" in done.stdout and str(loaded) in done.stdout
    assert [op.func_name for op in loaded.ops if op.kind == "op"] == ["add", "linear", "relu", "linear", "mul"]
    assert loaded["mul_1_5"].args == (None, 3.0)
    g = torch.Generator().manual_seed(0)  # the CLI's inputs: seed 0, one randn per --input, in order
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    assert torch.equal(loaded["input_1"].activation, x) and torch.equal(loaded["input_2"].activation, y)
    section = done.stdout.split("Hot path (duration, by op; top 2 of 5):\n")[1].split("  note:")[0]
    rows = section.strip().splitlines()
    assert len(rows) == 2 and all(row.split()[0] in [op.label for op in loaded.ops] for row in rows)


@pytest.mark.path_independent  # refused before any trace: once, on the first pass
def test_usage_errors_exit_2_with_a_clear_message(models):
    done = run(["trace", "clitargets:nothing_here", "--input", "2x8"], models)
    assert done.returncode == 2
    assert "clitargets has no attribute 'nothing_here'" in done.stderr and "Traceback" not in done.stderr


def test_model_errors_exit_1_naming_where_it_failed(models):
    done = run(["trace", "clitargets:Broken", "--input", "2x8"], models)
    assert done.returncode == 1
    assert "the model failed" in done.stderr and "mat1 and mat2 shapes cannot be multiplied" in done.stderr
    assert "module call blocks.1:1" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.path_independent  # fails before any trace: once, on the first pass
@pytest.mark.parametrize("source, stage", [
    ("import torch\ndef build():\n    raise RuntimeError('no weights here')\n", "building the model (broken:build())"),
    ("raise RuntimeError('no weights here')\n", "importing broken"),
], ids=["factory", "import"])
def test_a_failing_import_or_factory_is_not_called_the_model_failing(models, monkeypatch, capsys, source, stage):
    """An exception raised while importing the target's file or calling its factory was reported as "the model
    failed", as if the forward had raised: the message now names the stage that raised, with its line."""
    (models / "broken.py").write_text(source)
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    monkeypatch.delitem(sys.modules, "broken", raising=False)  # each case imports its own file
    try:
        assert main(["trace", "broken:build", "--input", "2x8"]) == 1
    finally:
        sys.modules.pop("broken", None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"torchlens: {stage} failed:" in err and "the model failed" not in err
    assert "RuntimeError: no weights here" in err and "broken.py:" in err


def test_a_model_error_names_the_line_in_a_package_whose_folder_name_begins_with_torchs(tmp_path, monkeypatch,
                                                                                         capsys):
    # torchvision/, torchaudio/ sit beside torch/ and begin with its name: they are not torch.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torchmodels").mkdir()
    (tmp_path / "torchmodels" / "net.py").write_text(textwrap.dedent('''
        import torch.nn as nn

        class Net(nn.Module):
            def forward(self, x):
                raise ValueError("bad input")
    '''))
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    assert main(["trace", str(tmp_path / "torchmodels" / "net.py") + ":Net", "--input", "2x8"]) == 1
    assert f"at {tmp_path / 'torchmodels' / 'net.py'}:6 in forward" in capsys.readouterr().err


def test_a_file_target_imports_the_modules_beside_it(tmp_path):
    # ``python net.py`` finds ``blocks.py`` beside it; the CLI loading net.py by path ended in
    # "No module named 'blocks'" unless the user's shell stood in that folder.
    project = tmp_path / "project"
    project.mkdir()
    (project / "blocks.py").write_text("import torch\nBlock = lambda: torch.nn.Linear(8, 8)\n")
    (project / "net.py").write_text("import torch\nfrom blocks import Block\n\n"
                                    "def build():\n    return torch.nn.Sequential(Block(), torch.nn.ReLU())\n")
    done = run(["trace", str(project / "net.py") + ":build", "--input", "2x8"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "linear_1_1:1" in done.stdout and "relu_1_2:1" in done.stdout


@pytest.mark.path_independent  # help only, no trace: once, on the first pass
def test_console_script_help_lists_every_command(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "torchlens")
    done = subprocess.run([script, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and all(c in done.stdout for c in ("demo", "trace", "show", "hot-path", "validate"))


def test_each_command_help_has_examples(capsys):
    for command in ("demo", "trace", "show", "hot-path", "validate"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"examples:\n  torchlens {command}" in capsys.readouterr().out


# In-process runs of the same entry point, for the many small error cases (each subprocess costs seconds).
@pytest.mark.parametrize("argv, message", [
    (["trace", "no_colon_here", "--input", "2x8"], "should look like pkg.module:factory"),
    (["trace", "clitargets:build", "--input", "2by8"], "write a shape as sizes joined by 'x'"),
    (["trace", "clitargets:build", "--input", "2x8", "--dtype", "floaty"], "'floaty' is not a torch dtype"),
    (["trace", "clitargets:build", "--input", "2x8", "--kwargs-json", "[1]"], "must be a JSON object"),
    (["trace", "clitargets:build", "--input", "2x8", "--kwargs-json", "{oops"], "not valid JSON"),
    (["trace", "no_such_module_xyz:build", "--input", "2x8"], "cannot import 'no_such_module_xyz'"),
    (["trace", "missing.py:build", "--input", "2x8"], "no such file: missing.py"),
    (["trace", "C:\\models\\clitargets.py", "--input", "2x8"],
     "names a file but no factory: add the factory's name after a colon (C:\\models\\clitargets.py:build)"),
    (["trace", "sub\\clitargets.py:build", "--input", "2x8"], "(folders are separated by '/' here: sub/clitargets.py)"),
    (["show", "not_a_folder"], "not a folder"),
    (["trace", "clitargets:needs_args", "--input", "2x8"], "cannot be called with no arguments"),
    # An imported Python module was "a module, not a module", a number "a int".
    (["trace", "clitargets:torch", "--input", "2x8"], "clitargets:torch is a Python module, not an nn.Module or a "
                                                       "factory"),
    (["trace", "clitargets:SIZE", "--input", "2x8"], "clitargets:SIZE is an int, not an nn.Module or a factory"),
])
def test_usage_errors_in_process(models, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_validate_and_module_instances(models, monkeypatch, capsys):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["validate", "clitargets:INSTANCE", "--input", "2x8", "--input", "2x8", "--eval"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("validation passed: 5 ops replayed exactly") and "outputs equal an untraced run: True" in out
    assert main(["trace", "clitargets.py:build", "--input", "2x8", "--input", "2x8", "--dtype", "float64"]) == 0
    assert "Trace of Pair" in capsys.readouterr().out
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--save", "s"]) == 0
    assert main(["hot-path", "s", "-n", "3", "--by", "memory"]) == 0
    out = capsys.readouterr().out
    assert "Hot path (memory, by op; top 3 of 5)" in out and out.count(" bytes  ") == 3
    assert main(["trace", "clitargets:build"]) == 2
    assert "at least one --input" in capsys.readouterr().err


def test_a_damaged_saved_trace_is_reported_not_raised(models, monkeypatch, capsys):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--save", "s"]) == 0
    with open(models / "s" / "trace.json", "ab") as f:
        f.write(b" ")
    assert main(["hot-path", "s"]) == 2
    assert "the manifest says" in capsys.readouterr().err


# ----- version, render, pipes, devices -------------------------------------------------------------------
def _saved(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    tl.trace(model, torch.randn(1, 4)).save(tmp_path / "s")
    return tmp_path / "s"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"torchlens {tl.__version__}"


@pytest.mark.parametrize("suffix, magic", [(".html", b"<!DOCTYPE html"), (".dot", b"digraph"), (".svg", b"<svg"),
                                           (".png", b"\x89PNG")])
def test_render_a_saved_trace(tmp_path, capsys, suffix, magic):
    if suffix in (".svg", ".png"):
        from torchlens.viz import LayoutEngineMissing, find_engine

        try:
            find_engine()
        except LayoutEngineMissing:
            pytest.skip("no layout engine")
    out = tmp_path / f"view{suffix}"
    assert main(["render", str(_saved(tmp_path)), "-o", str(out)]) == 0
    content = out.read_bytes()
    assert magic in content[:400]
    if suffix in (".dot", ".html"):
        assert b"linear_1_1" in content


@pytest.mark.parametrize("saved", [True, False])
def test_render_with_an_unknown_suffix_is_a_one_line_usage_error(tmp_path, capsys, monkeypatch, saved):
    """Told before the trace is loaded (so a damaged or missing one is not read for nothing)."""
    from torchlens import cli

    folder = _saved(tmp_path) if saved else tmp_path / "not_written_yet"
    monkeypatch.setattr(cli, "_load", lambda folder: pytest.fail("the trace was loaded before the suffix check"))
    assert main(["render", str(folder), "-o", str(tmp_path / "view.jpg")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "end the file name in .html, .svg, .png or .dot" in err[0]


def test_argument_mistakes_are_one_line_with_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["render", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-o/--output" in err and "torchlens render --help" in err


def test_a_missing_device_is_a_usage_error(models, monkeypatch, capsys):
    monkeypatch.chdir(models)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["trace", "clitargets:build", "--input", "2x8", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available on this machine; use --device cpu" in err and "Traceback" not in err
    assert main(["trace", "clitargets:build", "--input", "2x8", "--device", "gpu0"]) == 2
    assert "is not a torch device" in capsys.readouterr().err


def test_hot_path_says_how_many_rows_it_shows(tmp_path, capsys):
    assert main(["hot-path", str(_saved(tmp_path)), "-n", "5"]) == 0
    assert "top 3 of 3)" in capsys.readouterr().out  # three torch calls: not "top 5"


def test_hot_path_ranks_gradient_norms_and_bytes_saved_for_backward(tmp_path, capsys):
    # The library ranks by both; the command offered duration, FLOPs and memory only.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    log = tl.trace(model, torch.randn(3, 4), grads=True, saved_for_backward=True)
    log.backward(log.output.pow(2).sum())
    log.save(tmp_path / "g")
    norms = {op.label: float(op.grad.norm()) for op in log if op.requires_grad and op.grad is not None}
    assert main(["hot-path", str(tmp_path / "g"), "--by", "grad_norm", "-n", "1"]) == 0
    top = max(norms, key=norms.get)
    out = capsys.readouterr().out
    assert "Hot path (grad_norm" in out and f"{top} " in out and f"{norms[top]:.4g}" in out
    assert main(["hot-path", str(tmp_path / "g"), "--by", "saved_for_backward"]) == 0
    assert "Hot path (saved_for_backward" in capsys.readouterr().out
    # A metric the saved trace holds no values for is a usage problem (2), not a failed model (1).
    plain = str(_saved(tmp_path))
    assert main(["hot-path", plain, "--by", "grad_norm"]) == 2
    assert "grads=True" in capsys.readouterr().err
    assert main(["hot-path", plain, "--by", "saved_for_backward"]) == 2
    assert "saved_for_backward=True" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    saved = _saved(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for argv in (["show", str(saved)], ["--help"]):
        read, write = os.pipe()
        os.close(read)  # the reader has gone, as `| head` does once it has its lines
        try:
            done = subprocess.run([sys.executable, "-m", "torchlens", *argv], stdout=write, stderr=subprocess.PIPE,
                                  env=env, text=True, timeout=120)
        finally:
            os.close(write)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_names_the_console_encoding_lacks_print_escaped_not_as_an_error(tmp_path):
    # A Windows console or redirected file in cp1252 has no CJK characters; the trace is still printed.
    (tmp_path / "named.py").write_text(textwrap.dedent('''
        import torch.nn as nn

        class Named(nn.Module):
            def __init__(self):
                super().__init__()
                self.编码器 = nn.Linear(4, 2)

            def forward(self, x):
                return self.编码器(x)
    '''), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path), PYTHONIOENCODING="cp1252")
    for argv in (["trace", "named:Named", "--input", "2x4", "--save", "saved"], ["show", "saved", "--summary"]):
        done = subprocess.run([sys.executable, "-m", "torchlens", *argv], cwd=tmp_path, env=env, capture_output=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr.decode("cp1252", "replace")
        assert b"\\u7f16\\u7801\\u5668:1" in done.stdout  # the module call, its name escaped
    assert [m.address for m in tl.load(tmp_path / "saved").modules][-1] == "编码器"


def test_show_prints_the_module_summary(tmp_path, capsys):
    assert main(["show", str(_saved(tmp_path)), "--summary", "--depth", "1"]) == 0
    out = capsys.readouterr().out
    assert "Module call" in out and "FLOPs" in out and "0:1" in out and "Parameters: unknown" not in out


@pytest.mark.parametrize("dtype, high", [("int64", 0), ("int64", -3), ("int8", 300), ("uint8", 257)])
def test_integer_inputs_outside_the_dtype_or_an_empty_range_are_usage_errors(models, monkeypatch, capsys,
                                                                              dtype, high):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--dtype", dtype,
                 "--high", str(high)]) == 2
    assert f"--high {high}: integer inputs are drawn from [0, HIGH)" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    # A seed past 64 bits ended with status 1 and "ValueError: Overflow when unpacking long long", a shape past
    # what torch can allocate with "RuntimeError: Storage size calculation overflowed": both read as the model's.
    (["--seed", str(2 ** 70)], f"--seed {2 ** 70}: a seed is an integer from -2**63 to 2**64 - 1"),
    (["--input", "99999999999x99999999999"], "--input 99999999999x99999999999: cannot make a random tensor of that "
                                             "shape (Storage size calculation overflowed"),
])
def test_a_seed_or_a_shape_torch_cannot_take_is_a_usage_error(models, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", *extra]) == 2
    err = capsys.readouterr().err
    assert f"torchlens: error: {message}" in err and "the model failed" not in err


def test_integer_inputs_may_reach_the_top_of_their_dtype():
    from torchlens.cli.targets import make_inputs

    (x,) = make_inputs(["4096"], "int8", 0, 128, "cpu")  # [0, 128): every int8 from 0 up
    assert x.dtype == torch.int8 and int(x.min()) == 0 and int(x.max()) == 127


@pytest.mark.parametrize("flag", ["-n", "--depth"])
def test_a_negative_count_names_the_flag_the_user_typed(tmp_path, capsys, flag):
    assert main(["hot-path" if flag == "-n" else "show", str(_saved(tmp_path)), flag, "-1"]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} must be >= 0" in err and "--n " not in err


def test_eval_on_a_function_target_is_a_usage_error_and_without_it_the_function_traces(models, monkeypatch, capsys):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    argv = ["trace", "clitargets:as_function", "--input", "2x8", "--input", "2x8"]
    assert main(argv + ["--eval"]) == 2
    assert "--eval: clitargets:as_function gave a function, not a module" in capsys.readouterr().err
    assert main(argv) == 0  # the function itself traces


@pytest.mark.parametrize("argv, message", [
    (["trace", "clitargets:build", "--input", "2x8", "--html", "."],
     "--html . is a folder; give the name of a file you can write"),
    (["trace", "clitargets:build", "--input", "2x8", "--chrome", "no_such_dir/run.json"], "does not exist"),
    (["render", "no_such_trace", "-o", "no_such_dir/view.dot"], "does not exist"),
    (["demo", "--out", "clitargets.py"], "--out clitargets.py: that is a file"),
    (["trace", "clitargets:build", "--input", "2x8", "--save", "clitargets.py"],
     "--save clitargets.py exists and is a file, not a saved trace; choose another path"),
    # (its hint named no Python call: "log.save('run1')" is no command line)
    (["trace", "clitargets:build", "--input", "2x8", "--save", "."],
     "--save . is the current working directory; save the trace to a folder inside it (run1, not .)"),
    (["demo", "--out", "clitargets.py/demo"], "--out clitargets.py/demo: cannot create that folder (Not a directory)"),
])
def test_an_output_that_cannot_be_written_is_a_usage_error_before_any_work(models, monkeypatch, capsys, argv,
                                                                            message):
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "tracing" not in err and "loading" not in err  # refused before the model or the trace was touched


def test_an_output_file_in_a_folder_the_user_cannot_write_is_a_usage_error(models, monkeypatch, capsys):
    locked = models / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access",
                        lambda path, mode: os.path.abspath(path) != str(locked) and real_access(path, mode))
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--html", "locked/view.html"]) == 2
    err = capsys.readouterr().err
    assert f"--html locked/view.html is in {locked}, which is not writable" in err and "tracing" not in err
    # A file already there is written in place: its own permission decides, not the folder's.
    (locked / "old.html").write_text("old")
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--html", "locked/old.html"]) == 0
    assert (locked / "old.html").read_text() != "old"
    denied = str(locked / "old.html")
    monkeypatch.setattr(os, "access", lambda path, mode: os.path.abspath(path) not in (str(locked), denied))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--html", "locked/old.html"]) == 2
    assert "--html locked/old.html is a file that is not writable" in capsys.readouterr().err


def test_a_demo_folder_that_cannot_be_created_is_a_usage_error(tmp_path, monkeypatch, capsys):
    def denied(path, *args, **kwargs):  # what a folder under one the user may not write into gives
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "makedirs", denied)
    assert main(["demo", "--out", str(tmp_path / "locked" / "demo")]) == 2
    err = capsys.readouterr().err
    assert err == (f"torchlens: error: --out {tmp_path / 'locked' / 'demo'}: cannot create that folder (Permission "
                   "denied); give a folder you can write to\n")


def test_a_device_of_a_backend_this_torch_lacks_is_a_usage_error(models, monkeypatch, capsys):
    try:
        torch.empty(0, device="xla")
        pytest.skip("this torch has an XLA backend")
    except Exception:
        pass
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--device", "xla"]) == 2
    err = capsys.readouterr().err
    assert "--device xla: this torch cannot make tensors there" in err and "use --device cpu" in err
    assert "tracing" not in err


def test_without_a_layout_engine_the_html_view_is_skipped_and_the_rest_written(models, monkeypatch, capsys):
    # trace --html ended with status 1, "the model failed", and wrote no --chrome file; render's refusal said an
    # .html file needs no layout engine, which it does.
    import torchlens.viz.layout as layout

    def no_engine():
        raise layout.LayoutEngineMissing("no layout engine here")

    monkeypatch.setattr(layout, "find_engine", no_engine)
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--save", "run",
                 "--html", "view.html", "--chrome", "run.json"]) == 0
    assert "skipped the HTML view view.html: no layout engine here" in capsys.readouterr().err
    assert (models / "run.json").is_file() and not (models / "view.html").exists()
    assert main(["render", "run", "-o", "view.html"]) == 2
    assert "or write a .dot file, which needs no layout engine" in capsys.readouterr().err


def test_a_failing_layout_engine_is_named_as_such_not_as_the_model(models, monkeypatch, capsys):
    # render loads a saved trace and runs no model, yet a layout engine that exits with an error was reported as
    # "the model failed".
    import shutil

    failing = shutil.which("false")
    if failing is None:
        pytest.skip("no `false` command to stand for a failing layout engine")
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--save", "run"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("TORCHLENS_DOT", failing)
    assert main(["render", "run", "-o", "view.svg"]) == 1
    err = capsys.readouterr().err
    assert "torchlens: error: the layout engine failed: " in err and "the model failed" not in err
    assert not (models / "view.svg").exists()
    assert main(["render", "run", "-o", "view.dot"]) == 0  # DOT needs no engine
    # trace --html with that engine stopped before writing --chrome, and called the failure the model's.
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--save", "again",
                 "--chrome", "again.json", "--html", "again.html"]) == 1
    err = capsys.readouterr().err
    assert "torchlens: error: the layout engine failed: " in err and "wrote chrome trace: again.json" in err
    assert (models / "again.json").is_file() and (models / "again" / "manifest.json").is_file()


def test_the_module_tree_keeps_its_columns_in_line_past_long_labels():
    # A label longer than the 30-character column (T5's "<unregistered CrossEntropyLoss #1>:1") pushed that line's
    # class and op count out of line with the others.
    import torch.nn as nn

    from torchlens.cli import module_tree

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    model.add_module("a_module_name_well_past_thirty_characters", nn.Identity())
    rows = module_tree(tl.trace(model, torch.randn(2, 4)), 3).splitlines()[1:]
    classes = [row.index(name) for row, name in zip(rows, ["Linear", "Sequential", "ReLU", "Linear", "Identity"])]
    assert len(rows) == 5 and len(set(classes)) == 1


def test_the_hot_path_keeps_its_columns_in_line_past_long_addresses():
    # The address column was 36 characters: a source line in transformers
    # (transformers/models/gpt2/modeling_gpt2.py:695) pushed its count, total and share out of line.
    pytest.importorskip("transformers")
    import real_models

    from torchlens.cli import hot_path_text

    model, args, kwargs = real_models.build("gpt2")
    with real_models.in_mode(model, "eval"):
        log = tl.trace(model, args, kwargs)
    rows = hot_path_text(log, 10, by="flops", group="source").splitlines()[1:-1]
    addresses = [row.split()[0] for row in rows]
    assert len(rows) == 10 and max(map(len, addresses)) > 36
    counts = {row.index(" x", 2 + len(address)) for row, address in zip(rows, addresses)}
    assert len(counts) == 1


def test_a_package_a_command_needs_missing_is_a_usage_error_saying_what_to_install(models, monkeypatch, capsys):
    # Without safetensors, show, hot-path and render ended with status 1, as a failing model does, and with
    # "ImportError: ... (rerun with --traceback for the full traceback)", as a fault of torchlens's own.
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", "--save", "run"]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    for command in (["show", "run"], ["hot-path", "run"], ["render", "run", "-o", "view.dot"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "torchlens: error: reading a saved trace's tensors needs safetensors: pip install safetensors" in err
        assert "--traceback" not in err and "ImportError" not in err


@pytest.mark.parametrize("flag", ["--save", "--html", "--chrome"])
def test_an_empty_output_flag_is_refused_not_skipped(models, monkeypatch, capsys, flag):
    # --save "" (or --html "", --chrome "") traced, printed and wrote nothing, exiting 0 as if it had.
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "clitargets:build", "--input", "2x8", "--input", "2x8", flag, ""]) == 2
    assert f"{flag} " in capsys.readouterr().err and sorted(p.name for p in models.iterdir()) == ["clitargets.py"]


def test_a_misspelt_factory_is_answered_with_the_closest_names(models, monkeypatch, capsys):
    # torch.nn:Lineer listed the first twelve names torch.nn defines (AdaptiveAvgPool1d, ...), not Linear.
    monkeypatch.chdir(models)
    monkeypatch.syspath_prepend(str(models))
    assert main(["trace", "torch.nn:Lineer", "--input", "2x8"]) == 2
    assert "torch.nn has no attribute 'Lineer'; closest: Linear" in capsys.readouterr().err
    assert main(["trace", "clitargets:BUILD", "--input", "2x8"]) == 2
    assert "clitargets has no attribute 'BUILD'; closest: build" in capsys.readouterr().err
