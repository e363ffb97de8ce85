"""The ``torchlens`` command line (also ``python -m torchlens``): trace, inspect and check models from a shell.

Results go to stdout, progress notes to stderr.  Exit status: 0 success, 2 a usage problem (bad
arguments, an unimportable target, a damaged saved trace), 1 the model failed (the message names the
op or module call where it raised; or the target's import or factory, named so) or validation found a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from ..errors import counted
from .targets import (MODEL, USAGE, ModelError, UsageError, check_output_file, check_save_folder, make_output_folder,
                      note, prepare)


# ----- printing -----------------------------------------------------------------------------------------
def module_tree(log, depth: int) -> str:
    """Module calls down to ``depth`` levels, indented, with op counts and instrumented host times."""
    lines = [f"Module calls (to depth {depth}):"]
    shown = [call for call in log.module_calls if call.depth < depth]
    names = ["  " * call.depth + call.label for call in shown]
    # Columns as wide as their longest entry (at least as before): a long label keeps the columns in line.
    name_width = max([30, *map(len, names)])
    class_width = max([20, *(len(call.module.class_name) for call in shown)])
    for call, name in zip(shown, names):
        ms = f"{call.duration * 1e3:.2f} ms" if call.duration is not None else "did not return"
        lines.append(f"  {name:<{name_width}} {call.module.class_name:<{class_width}} "
                     f"{counted(len(call.ops), 'op'):>9}  {ms}")
    if len(lines) == 1:
        lines.append("  (the model made no module calls)")
    return "\n".join(lines)


def hot_path_text(log, n: int, by: str = "duration", group: str = "op") -> str:
    from ..debug.hotspots import ZERO_TOTAL_NOTE, hot_path, percent_text

    ranked = hot_path(log, by=by, group=group)
    lines = [f"Hot path ({by}, by {group}; top {min(n, len(ranked.rows))} of {len(ranked.rows)}):"]
    unit = "ms" if by == "duration" else ranked.unit
    # As wide as the longest address shown (at least as before): a source file's path
    # (transformers/models/gpt2/modeling_gpt2.py:695) pushed its line's count and total out of line.
    width = max([36, *(len(row["address"]) for row in ranked.rows[:n])])
    for row in ranked.rows[:n]:
        total = row["total"] * 1e3 if by == "duration" else row["total"]
        shown = f"{total:.3f}" if by == "duration" else f"{total:.4g}" if by == "grad_norm" else f"{int(total):,}"
        percent = percent_text(row["percent"], ranked.total)
        lines.append(f"  {row['address']:<{width}} x{row['count']:<4} {shown:>14} {unit}  {percent:>6}")
    if ranked.excluded:
        lines.append(f"  excluded (no {by} value): {counted(len(ranked.excluded), 'op')}")
    if ranked.rows and ranked.total == 0:
        lines.append(f"  {ZERO_TOTAL_NOTE}")
    lines.append(f"  note: {ranked.note}")
    return "\n".join(lines)


def _write_exports(log, save=None, html=None, chrome=None, depth=None) -> list:
    written = []

    def wrote(what, path):
        written.append((what, path))
        note(f"wrote {what}: {path}")

    if save:
        log.save(save, overwrite=_is_saved_trace(save))
        wrote("saved trace", save)
    if chrome:
        if log.to_chrome_trace(chrome) is not None or os.path.exists(chrome):
            wrote("chrome trace", chrome)
    if html:  # last: a layout engine that fails then leaves the other exports written
        from ..viz import LayoutEngineMissing

        try:
            if log.render(html, format="html", depth=depth) is not None or os.path.exists(html):
                wrote("HTML view", html)
        except LayoutEngineMissing as exc:  # the trace is fine: say what was left out, and write the rest
            note(f"skipped the HTML view {html}: {exc}")
    return written


def _is_saved_trace(path) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))


# ----- commands -----------------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    import torchlens as tl
    from torchlens.demo import demo_model

    make_output_folder("--out", args.out)
    model, x = demo_model()
    note(f"tracing the built-in demo model ({type(model).__name__}) on a {'x'.join(map(str, x.shape))} input")
    log = tl.trace(model, x, name="DemoNet")
    print(log)
    print()
    print(module_tree(log, 2))
    print()
    print(hot_path_text(log, 10))
    written = _write_exports(log, save=os.path.join(args.out, "trace"), html=os.path.join(args.out, "demo.html"),
                             chrome=os.path.join(args.out, "demo.chrome.json"))
    print()
    print(f"Demo outputs in {os.path.abspath(args.out)}:")
    for what, path in written:
        print(f"  {what:<14} {path}")
    print(f"Next: torchlens show {os.path.join(args.out, 'trace')}")
    return 0


def cmd_trace(args) -> int:
    import torchlens as tl

    check_save_folder("--save", args.save)
    check_output_file("--html", args.html)
    check_output_file("--chrome", args.chrome)
    model, inputs, kwargs = prepare(args)
    note(f"tracing {type(model).__name__} on {', '.join(args.input)} ({args.dtype})")
    started = time.perf_counter()
    try:
        log = tl.trace(model, inputs, kwargs, save="all" if (args.save or args.html) else "none")
    except Exception as exc:
        raise ModelError(exc) from exc
    note(f"traced {counted(len(log), 'op')} in {time.perf_counter() - started:.2f} s")
    print(log)
    if args.depth is not None:
        print()
        print(module_tree(log, args.depth))
    if args.hot_path:
        print()
        print(hot_path_text(log, args.hot_path))
    from ..viz import LayoutFailed

    try:
        _write_exports(log, save=args.save, html=args.html, chrome=args.chrome, depth=args.depth)
    except LayoutFailed as exc:  # the other exports are written by then (the HTML view comes last)
        return _layout_failed(exc, args)
    return 0


def _load(path):
    import torchlens as tl

    note(f"loading {path}")
    return tl.load(path)


def cmd_show(args) -> int:
    log = _load(args.dir)
    print(log)
    if args.summary:
        print()
        print(log.summary(depth=args.depth))
    elif args.depth is not None:
        print()
        print(module_tree(log, args.depth))
    return 0


def cmd_hot_path(args) -> int:
    from ..errors import GradientUnavailable

    log = _load(args.dir)
    try:
        text = hot_path_text(log, args.n, by=args.by, group=args.group)
    except (ValueError, GradientUnavailable) as exc:  # a --by this saved trace holds no values for
        raise UsageError(str(exc)) from None
    print(text)
    return 0


def cmd_render(args) -> int:
    from ..viz import LayoutEngineMissing, LayoutFailed, format_of

    check_output_file("-o", args.output)
    try:
        format_of(args.output)
    except ValueError:
        raise UsageError(f"-o {args.output}: the suffix picks the format: end the file name in .html, .svg, .png "
                         "or .dot") from None
    log = _load(args.dir)
    try:
        written = log.render(args.output, view=args.view, depth=args.depth, direction=args.direction)
    except ValueError as exc:  # an option render refused, for this trace
        raise UsageError(str(exc)) from None
    except LayoutEngineMissing as exc:
        raise UsageError(f"{exc} (or write a .dot file, which needs no layout engine)") from None
    except LayoutFailed as exc:  # no model ran here: the engine itself failed, which is no usage problem either
        return _layout_failed(exc, args)
    note(f"wrote {written}")
    return 0


def _layout_failed(exc, args) -> int:
    """The exit of a command whose layout engine failed: named as such (not as the model, not as a usage error)."""
    if args.traceback:
        raise exc
    print(f"torchlens: error: the layout engine failed: {exc}", file=sys.stderr)
    return MODEL


def cmd_validate(args) -> int:
    import torchlens as tl

    model, inputs, kwargs = prepare(args)
    note(f"validating {type(model).__name__}: an untraced run, a traced run, and a replay of every op")
    try:
        result = tl.validate(model, inputs, kwargs)
    except Exception as exc:
        raise ModelError(exc) from exc
    print(result)
    return 0 if result.passed else MODEL


# ----- the parser ---------------------------------------------------------------------------------------
_EXAMPLES = {
    "demo": "examples:\n  torchlens demo\n  torchlens demo --out /tmp/tl-demo",
    "trace": "examples:\n  torchlens trace torchvision.models:resnet18 --input 1x3x224x224 --hot-path 10\n"
             "  torchlens trace mymodels.py:build --input 2x16 --input 2x16 --save run1 --html run1.html\n"
             "  torchlens trace mypkg.nets:Encoder --input 4x128 --dtype int64 --high 1000 "
             "--kwargs-json '{\"causal\": true}'",
    "show": "examples:\n  torchlens show run1\n  torchlens show run1 --depth 2\n"
            "  torchlens show run1 --summary --depth 2",
    "hot-path": "examples:\n  torchlens hot-path run1\n  torchlens hot-path run1 -n 5 --by flops --group module",
    "render": "examples:\n  torchlens render run1 -o view.html\n  torchlens render run1 -o graph.svg --view rolled "
              "--depth 2",
    "validate": "examples:\n  torchlens validate mymodels.py:build --input 2x16\n"
                "  torchlens validate torchvision.models:resnet18 --input 1x3x64x64 --eval",
}


def _target_options(p) -> None:
    p.add_argument("target", help="pkg.module:factory or path/to/file.py:factory (a module instance, a module "
                                  "class, or a callable returning a module)")
    p.add_argument("--input", action="append", metavar="SHAPE", default=[],
                   help="shape of one random positional input, e.g. 1x3x224x224; repeat for several arguments")
    p.add_argument("--dtype", default="float32", help="dtype of the random inputs (default float32); a floating "
                                                      "dtype also converts the model's parameters")
    p.add_argument("--high", type=int, default=10, help="integer inputs are drawn from [0, HIGH) (default 10)")
    p.add_argument("--kwargs-json", metavar="JSON", help="keyword arguments for forward, as a JSON object")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--device", default="cpu", help="device for the model and inputs (default cpu)")
    p.add_argument("--eval", action="store_true", help="call model.eval() first (default: keep the factory's mode)")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line saying what to do (status 2), not the usage block."""

    def error(self, message):
        self.exit(USAGE, f"torchlens: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(
        prog="torchlens", description="Trace a PyTorch forward pass: every op named, placed and recorded.",
        epilog="Run 'torchlens COMMAND --help' for each command's options and examples.")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback when a model fails")
    parser.add_argument("--version", action="version", version=f"torchlens {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, run, help_text):
        p = commands.add_parser(name, help=help_text, description=help_text, epilog=_EXAMPLES[name],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=run)
        return p

    demo = command("demo", cmd_demo, "trace the built-in demo model; print its summary and hot path and write "
                                     "the saved trace, HTML view and chrome trace into a folder")
    demo.add_argument("--out", default="torchlens_demo", help="folder for the outputs (default ./torchlens_demo)")

    trace = command("trace", cmd_trace, "trace a model on random inputs and print the summary")
    _target_options(trace)
    trace.add_argument("--save", metavar="DIR", help="save the trace (with activations) to this folder")
    trace.add_argument("--html", metavar="FILE", help="write the HTML view of the graph")
    trace.add_argument("--chrome", metavar="FILE", help="write a chrome://tracing / Perfetto JSON of host times")
    trace.add_argument("--hot-path", type=int, metavar="N", help="print the N ops with the most host time")
    trace.add_argument("--depth", type=int, metavar="N", help="print module calls down to depth N (the HTML view "
                                                              "then opens collapsed below that depth)")

    show = command("show", cmd_show, "print the summary of a saved trace")
    show.add_argument("dir", help="a folder written by log.save or 'torchlens trace --save'")
    show.add_argument("--depth", type=int, metavar="N", help="also print module calls down to depth N")
    show.add_argument("--summary", action="store_true", help="print the module summary table (parameters, "
                                                              "shapes, ops, FLOPs, time, bytes; to --depth)")

    hot = command("hot-path", cmd_hot_path, "rank the ops of a saved trace by host time, FLOPs, memory, gradient "
                                            "norm or bytes saved for backward")
    hot.add_argument("dir", help="a folder written by log.save or 'torchlens trace --save'")
    hot.add_argument("-n", type=int, default=10, help="rows to print (default 10)")
    # grad_norm and saved_for_backward rank what a trace saved with grads=True (after a backward) or
    # saved_for_backward=True holds; a trace without it is refused with the option to trace it with.
    hot.add_argument("--by", default="duration",
                     choices=["duration", "flops", "memory", "grad_norm", "saved_for_backward"])
    hot.add_argument("--group", default="op", choices=["op", "layer", "module", "source"])

    draw = command("render", cmd_render, "draw a saved trace: an interactive .html viewer, or a .svg, .png or .dot "
                                         "picture")
    draw.add_argument("dir", help="a folder written by log.save or 'torchlens trace --save'")
    draw.add_argument("-o", "--output", required=True, metavar="FILE",
                      help="where to write; the suffix (.html, .svg, .png, .dot) picks the format")
    draw.add_argument("--view", default="unrolled", choices=["unrolled", "rolled"],
                      help="one node per op (unrolled, default) or per layer with passes folded (rolled)")
    draw.add_argument("--depth", type=int, metavar="N", help="collapse module calls N levels down into one node")
    draw.add_argument("--direction", default="TB", choices=["TB", "LR"],
                      help="data flows top to bottom (TB, default) or left to right (LR: deep models)")

    check = command("validate", cmd_validate, "check that a trace of the model reproduces an untraced run and "
                                              "that every op replays to its recorded output")
    _target_options(check)
    return parser


def main(argv=None) -> int:
    restore = _escape_unprintable_output()
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe could not be handled
        return status
    except SystemExit as stop:  # argparse's --help / --version, which print before exiting
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
            return 0
        raise stop
    except BrokenPipeError:
        # The reader (``| head``) stopped listening: that is the reader's choice, not a failure.
        _silence_stdout()
        return 0
    finally:
        restore()


def _escape_unprintable_output():
    """Have stdout write a character its encoding lacks (CJK in cp1252, a Windows file) as a backslash escape,
    as stderr does, rather than end in UnicodeEncodeError after the work; returns what undoes it."""
    stream, errors = sys.stdout, getattr(sys.stdout, "errors", None)
    if errors is None or not hasattr(stream, "reconfigure"):
        return lambda: None
    stream.reconfigure(errors="backslashreplace")
    return lambda: stream.reconfigure(errors=errors)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
    except (OSError, ValueError):
        pass


# The options that count something, by argparse name, with the flag a user types (``-n`` has no long form).
_COUNT_FLAGS = {"n": "-n", "hot_path": "--hot-path", "depth": "--depth"}


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name, flag in _COUNT_FLAGS.items():
        if getattr(args, name, None) is not None and getattr(args, name) < 0:
            print(f"torchlens: error: {flag} must be >= 0", file=sys.stderr)
            return USAGE
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"torchlens: error: {exc}", file=sys.stderr)
        return USAGE
    except ModelError as exc:
        _report_model_error(exc.__cause__ or exc, args.traceback, exc.stage)
        return MODEL
    except KeyboardInterrupt:
        print("torchlens: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from ..errors import MissingPackage
        from ..io.format import TraceFileError

        # A package the command needs that is not installed is no failure of the model's: the message says what to do
        if isinstance(exc, (TraceFileError, FileNotFoundError, MissingPackage)):
            print(f"torchlens: error: {exc}", file=sys.stderr)
            return USAGE
        if isinstance(exc, BrokenPipeError) or args.traceback:
            raise
        print(f"torchlens: error: {type(exc).__name__}: {exc} (rerun with --traceback for the full traceback)",
              file=sys.stderr)
        return MODEL


def _report_model_error(exc: BaseException, full: bool, stage: str = "the model") -> None:
    if full:
        traceback.print_exception(exc, file=sys.stderr)
    else:
        print(f"torchlens: {stage} failed:", file=sys.stderr)
        sys.stderr.write("".join("  " + line for line in traceback.format_exception_only(exc)))
        frame = _user_frame(exc)
        if frame:
            print(f"  at {frame}", file=sys.stderr)
        print("  (rerun with --traceback for the full traceback)", file=sys.stderr)


def _user_frame(exc) -> str | None:
    """The innermost traceback frame outside torch and torchlens (each folder with its separator: torchvision/
    is not torch/): usually the user's failing line."""
    import torch

    package = os.path.dirname(os.path.dirname(__file__))  # torchlens/, not torchlens/cli/
    skip = (os.path.join(os.path.dirname(torch.__file__), ""), os.path.join(package, ""))
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith(skip):
            found = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return found

