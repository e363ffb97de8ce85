"""Reports that bridge a trace to PyTorch's native tools (FLOPs, kernel profiles, chrome traces), and patching
experiments as tables; and the paired-ratio overhead harness (``measure_overhead``)."""

import importlib

_EXPORTS = {
    "flops": ".flops",
    "op_flops": ".flops",
    "total_flops": ".flops",
    "flops_vs_dispatch": ".flops_compare",
    "kernel_profile": ".kernel_profiling",  # a module named kernel_profile would shadow the function
    "KernelProfile": ".kernel_profiling",
    "to_chrome_trace": ".chrome",
    "activation_patching": ".patching",
    "attribution_patching": ".patching",
    "measure_overhead": ".overhead",  # the paired-ratio harness behind every published overhead figure
    "RefusalPredicate": ".overhead",
    "OverheadResult": ".overhead",
}


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name], __name__)
        # ``flops`` names its submodule itself (the registry); every other name is defined in its module.
        value = module if name == "flops" else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchlens.report' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))  # lazy names listed without importing them


__all__ = list(_EXPORTS)
