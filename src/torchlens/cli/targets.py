"""What a command runs: the model a target names, the inputs made for it, and the checks of the files and
device the command will use, each refused in one line before any work (``UsageError``, exit status 2)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys

from ..checks import is_a, unwritable_file
from ..errors import closest_hint

USAGE, MODEL = 2, 1


class UsageError(Exception):
    """Raised for anything the user can fix on the command line; exits with status 2."""


class ModelError(Exception):
    """Wraps an exception the user's code raised; exits with status 1.  ``stage`` names what was running (the
    import of the target's file, its factory, or the model), so a failing import is not read as the forward's."""

    def __init__(self, cause: BaseException, stage: str = "the model"):
        super().__init__(cause)
        self.stage = stage


def note(message: str) -> None:
    """A progress note, on stderr: stdout holds the results alone, for a pipe."""
    print(f"torchlens: {message}", file=sys.stderr, flush=True)


# ----- targets and inputs -------------------------------------------------------------------------------
def load_target(spec: str):
    """The model named by ``pkg.module:factory`` or ``path/to/file.py:factory``."""
    module_name, sep, attr_path = spec.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(f"target {spec!r} should look like pkg.module:factory or path/to/file.py:factory")
    if attr_path.endswith(".py") or "/" in attr_path or "\\" in attr_path:  # C:\m\model.py: the drive's colon
        raise UsageError(f"target {spec!r} names a file but no factory: add the factory's name after a colon "
                         f"({spec}:build)")
    module = _import(module_name)
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            known = closest_hint(part, names) or f" (it defines: {', '.join(names[:12])})"  # the first, if none is near
            raise UsageError(f"{module_name} has no attribute {attr_path!r}{known}")
        obj = getattr(obj, part)
    return _build_model(obj, spec)


def _import(module_name: str):
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            forward = module_name.replace("\\", "/")  # a path written for Windows, on a system where '/' separates
            hint = "" if os.sep != "/" or forward == module_name else f" (folders are separated by '/' here: {forward})"
            raise UsageError(f"no such file: {module_name}{hint}")
        folder = os.path.dirname(os.path.abspath(module_name))
        if folder not in sys.path:  # as ``python file.py`` does: the file imports the modules beside it
            sys.path.insert(0, folder)
        name = "_torchlens_target_" + os.path.splitext(os.path.basename(module_name))[0]
        spec = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader = lambda: spec.loader.exec_module(module)  # noqa: E731
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # the console script, unlike python -m, does not add it
        loader = lambda: importlib.import_module(module_name)  # noqa: E731
        module = None
    note(f"importing {module_name}")
    try:
        result = loader()
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UsageError(f"cannot import {module_name!r}: {exc} (is it on PYTHONPATH?)") from None
        raise ModelError(exc, f"importing {module_name}") from exc
    except Exception as exc:
        raise ModelError(exc, f"importing {module_name}") from exc
    return module if module is not None else result


def _build_model(obj, spec):
    import torch

    if isinstance(obj, torch.nn.Module):
        return obj
    if not callable(obj):
        # A Python module (``pkg:torch``) is no nn.Module: say which kind of module it is.
        what = "is a Python module" if inspect.ismodule(obj) else is_a(obj)
        raise UsageError(f"{spec} {what}, not an nn.Module or a factory returning one")
    try:
        inspect.signature(obj).bind()
    except TypeError as exc:
        raise UsageError(f"{spec} cannot be called with no arguments ({exc}); point at a factory that takes none") \
            from None
    except ValueError:
        pass  # no introspectable signature (some builtins): just call it
    try:
        model = obj()
    except Exception as exc:
        raise ModelError(exc, f"building the model ({spec}())") from exc
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise UsageError(f"{spec}() returned a value of type {type(model).__name__}, not a module")
    return model


def parse_shape(text: str) -> tuple:
    parts = text.lower().split("x")
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"--input {text!r}: write a shape as sizes joined by 'x', e.g. 1x3x224x224")
    return tuple(int(p) for p in parts)


def make_inputs(shapes, dtype_name, seed, high, device):
    import torch

    from ..io.encode import torch_constant

    try:
        dtype = torch_constant("dtype", dtype_name)
    except ValueError:
        raise UsageError(f"--dtype {dtype_name!r} is not a torch dtype (try float32, float16, int64)") from None
    try:
        g = torch.Generator().manual_seed(seed)
    except (RuntimeError, ValueError, OverflowError):
        raise UsageError(f"--seed {seed}: a seed is an integer from -2**63 to 2**64 - 1") from None
    args = []
    for text in shapes:
        shape = parse_shape(text)
        high_for_ints = None if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool else \
            checked_high(dtype, dtype_name, high)
        try:
            t = _random_input(shape, dtype, high_for_ints, g)
        except (RuntimeError, MemoryError) as exc:  # a shape past what torch can allocate: the input, not the model
            raise UsageError(f"--input {text}: cannot make a random tensor of that shape "
                             f"({str(exc).splitlines()[0]}); give a smaller one") from None
        args.append(t.to(device))
    return tuple(args)


def _random_input(shape, dtype, high, g):
    """A random input: normal for a floating or complex dtype, 0 or 1 for bool, integers in ``[0, high)``."""
    import torch

    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, high, shape, generator=g).to(dtype)


def checked_high(dtype, dtype_name: str, high: int) -> int:
    """``--high`` for integer inputs, drawn from ``[0, high)``: at least 1, and no more than the dtype holds
    (a value past it would wrap, ``.to(int8)`` making 300 a negative token id)."""
    import torch

    top = torch.iinfo(dtype).max + 1
    if not 1 <= high <= top:
        raise UsageError(f"--high {high}: integer inputs are drawn from [0, HIGH), so HIGH must be between 1 and "
                         f"{top} for {dtype_name}")
    return high


def check_device(name: str) -> None:
    """Refuse a device this machine lacks before importing the model (one line, not a traceback)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a torch device (try cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices "
                         f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine; use --device cpu")


def check_output_file(flag: str, path) -> None:
    """Refuse, before any work, a file the command could not write (a folder's name, a file in a folder that
    does not exist or is not writable), rather than after a trace that may have taken minutes."""
    problem = None if path is None else unwritable_file(path)
    if problem:
        raise UsageError(f"{flag} {path or repr(path)} {problem}; give the name of a file you can write")


def check_save_folder(flag: str, path) -> None:
    """Refuse, before any work, a folder ``log.save`` would refuse (a file, a folder holding other files), by
    the same check it makes; a saved trace there is replaced, as the command does."""
    if path is None:
        return
    from ..io.format import TraceFileError
    from ..io.save import check_save_target

    try:
        check_save_target(path, overwrite=True)
    except TraceFileError as exc:
        raise UsageError(f"{flag} {exc}") from None


def make_output_folder(flag: str, path) -> None:
    """Create the folder the command writes into, or refuse in one line one it could not create or write
    into (a file's name, a path under a file, no permission), before any work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: that is a file; give a folder to write the outputs into")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create that folder ({exc.strerror or exc}); give a folder "
                         "you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot write into that folder (permission denied); give a folder you "
                         "can write to")


def check_backend(name: str) -> None:
    """A device of another backend (``xla``, ``xpu``, ``hpu``) this torch cannot make tensors on: one line, not
    the backend's own exception.  Asked after the target's import, which may be what registers the backend."""
    import torch

    device = torch.device(name)
    if device.type in ("cpu", "meta", "cuda", "mps"):
        return  # cpu and meta always work; cuda and mps were checked before the import
    try:
        torch.empty(0, device=device)
    except Exception as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0].split(". ")[0].rstrip(".")
        raise UsageError(f"--device {name}: this torch cannot make tensors there ({reason}); "
                         "use --device cpu, or install and import the backend") from None


def parse_kwargs(text):
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--kwargs-json is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise UsageError("--kwargs-json must be a JSON object, e.g. '{\"return_loss\": false}'")
    return kwargs


def prepare(args):
    """Model, positional inputs and keyword arguments from the shared target options."""
    import torch

    if not args.input:
        raise UsageError("give at least one --input SHAPE (one per positional argument of forward)")
    kwargs = parse_kwargs(args.kwargs_json)
    check_device(args.device)
    model = load_target(args.target)
    check_backend(args.device)
    if args.eval:
        if not isinstance(model, torch.nn.Module):  # a plain function: no train/eval mode to switch
            raise UsageError(f"--eval: {args.target} gave a {type(model).__name__}, not a module, so it has no "
                             "eval mode to switch to; drop --eval, or return the module itself")
        model.eval()
    inputs = make_inputs(args.input, args.dtype, args.seed, args.high, args.device)
    dtype = inputs[0].dtype
    try:
        if isinstance(model, torch.nn.Module):
            # A floating --dtype is the precision to run in: parameters follow it, integer inputs do not.
            model = model.to(args.device, dtype) if dtype.is_floating_point else model.to(args.device)
    except Exception as exc:
        raise ModelError(exc) from exc
    return model, inputs, kwargs
