"""Reports that bridge a trace to PyTorch's native tools: FLOPs, kernel profiles, chrome traces."""

import importlib

_EXPORTS = {
    "flops": ".flops",
    "op_flops": ".flops",
    "total_flops": ".flops",
    "flops_vs_dispatch": ".flops_vs_dispatch",
    "kernel_profile": ".kernel_profile",
    "KernelProfile": ".kernel_profile",
    "to_chrome_trace": ".chrome",
}


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchlens.report' has no attribute {name!r}")


__all__ = list(_EXPORTS)
