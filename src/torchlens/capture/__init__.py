"""Capture: interposition (mode.py), module calls (modules.py), user source lines (source.py), the save
policy (saving.py), the fast-path shim (fastpath.py), and the driver (session.py)."""

import warnings

import torch

# The torch release this torchlens is verified against (pyproject.toml's range): capture relies on torch
# internals (higher-order ops, autograd.Function.apply, checkpoint regions) that change between releases.
TORCH_VERIFIED = "2.13"
if ".".join(torch.__version__.split(".")[:2]) != TORCH_VERIFIED:
    warnings.warn(f"torchlens is verified with torch {TORCH_VERIFIED}.x, not {torch.__version__}: traces may miss "
                  f"or misrecord what this torch does differently; install torch=={TORCH_VERIFIED}.*",
                  RuntimeWarning, stacklevel=2)
