"""The optional compiled hot path: the ``torchlens-accel`` distribution (``pip install torchlens[fast]``).

Pure Python is the default and records everything.  When ``torchlens_accel`` is installed and built for
this revision (each module's ``ABI`` equals the one named here), capture uses its compiled versions of
the hot path instead; they record exactly what the pure-Python path records, which the test suite checks
by tracing the same models both ways.  ``TORCHLENS_ACCEL=0`` in the environment, or ``use(False)``, keeps
capture on the pure-Python path.  Two modules are built against torch's headers: ``_autograd`` (gradient
hooks as autograd's C++ hooks) and ``_reads`` (reads of torch's state that its Python bindings make
slowly: saved tensors' and parameters' versions, parameters' requires_grad flags, the autocast state and an
output's record fields per op).  Each is used only
with the torch it was built for; without them gradient capture takes the ``_grads`` hooks and the reads
go through torch's bindings.  All of them are imported with this module, never during a trace (``_load_all``).
"""

from __future__ import annotations

import contextlib
import os
import warnings

# What each compiled module must be built for (its ``ABI``): bumped, here and in its C file, whenever the
# objects it exchanges with this package change shape.
ABI = {"_capture": 23, "_dispatch": 1, "_grads": 5, "_index": 2, "_autograd": 6, "_reads": 5}

_enabled = os.environ.get("TORCHLENS_ACCEL", "1") != "0"
_modules: dict = {}


def _load(name: str):
    """``torchlens_accel.<name>`` if installed and built for this layout, else None (warned once)."""
    if name in _modules:
        return _modules[name]
    try:
        module = __import__(f"torchlens_accel.{name}", fromlist=[name])
    except (ImportError, OSError):  # not built, or (a module built against torch) built for another torch
        module = None
    built_for = getattr(module, "TORCH_VERSION", None)
    if built_for is not None and built_for != _torch_version():
        warnings.warn(f"torchlens-accel's {name} was built for torch {built_for}, not {_torch_version()}: it is "
                      "not used; reinstall torchlens-accel with this torch installed", RuntimeWarning, stacklevel=3)
        module = None
    if module is not None and getattr(module, "ABI", None) != ABI.get(name):
        warnings.warn(f"torchlens-accel's {name} is built for layout {getattr(module, 'ABI', None)}, "
                      f"this torchlens needs {ABI.get(name)}: capture runs on the pure-Python path; reinstall "
                      "torchlens-accel from the same revision as torchlens", RuntimeWarning, stacklevel=3)
        module = None
    _modules[name] = module
    return module


def _torch_version() -> str:
    import torch

    return torch.__version__


def compiled(name: str):
    """The compiled module ``name`` when the accelerator is in use, else None (use the Python path)."""
    if not _enabled:
        return None
    module = _modules.get(name, _modules)  # a trace asks several times: loaded once, then one lookup
    return _load(name) if module is _modules else module


def available() -> bool:
    """Whether the compiled hot path is installed and matches this torchlens."""
    return _load("_capture") is not None


def active() -> bool:
    """Whether capture uses the compiled hot path now."""
    return _enabled and available()


@contextlib.contextmanager
def without(*names: str):
    """Inside the block, the compiled modules ``names`` count as not built (``without("_autograd")``:
    gradient capture takes the ``_grads`` hooks): for comparing the paths side by side."""
    kept = {name: _load(name) for name in names}
    _modules.update(dict.fromkeys(kept))
    try:
        yield
    finally:
        _modules.update(kept)


def use(enabled: bool) -> bool:
    """Turn the compiled hot path on or off for traces started from now on; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    _load_all()
    return previous


def _load_all() -> None:
    """Import every compiled module now, not during a trace: an extension module imported inside the user's
    ``torch.profiler.profile(with_stack=True)`` block leaves the profiler's Python tracer holding names that
    are freed before it reads them (a torch bug), and reading that block's events then raises
    ``UnicodeDecodeError``."""
    if _enabled:
        for name in ABI:
            _load(name)


_load_all()
