"""Reports that bridge a trace to PyTorch's native tools (FLOPs, kernel profiles, chrome traces), and patching
experiments as tables; and the paired-ratio overhead harness (``measure_overhead``)."""

from ..lazy import exports

_EXPORTS = {
    "flops": (".flops", None),  # the submodule itself (the registry)
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


__getattr__, __dir__ = exports(__name__, _EXPORTS)

__all__ = list(_EXPORTS)
