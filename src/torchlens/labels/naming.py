"""Op type names and label formats.

The grammar follows the reference library so that its users can switch without relearning addresses:
an op's type is the torch function's name, lowercased, with dunder marks and every underscore removed
(``max_pool2d`` -> ``maxpool2d``, ``__getitem__`` -> ``getitem``, ``relu_`` -> ``relu``), without the
overload of an operator called directly (``torch.ops.aten.add.Tensor`` -> ``add``), and without the namespace
of a ``torch.linalg``, ``torch.special`` or ``torch.fft`` function (``torch.linalg.vector_norm`` ->
``vectornorm``).  Only the
commutative reflected operators map back to their forward name (``__radd__`` -> ``add``).
"""

from __future__ import annotations

import functools
import re

# An op or layer label (``linear_1_1``, ``linear_1_1:2``, ``input_1:1``): what a module address never looks like,
# unless a module is named so, which the readers of a name then refuse as ambiguous.
LABEL = re.compile(r"^[a-z0-9]+_\d+(_\d+)?(:\d+)?$")

_REFLECTED_TO_FORWARD = {
    "__radd__": "add",
    "__rmul__": "mul",
    "__rand__": "and",
    "__ror__": "or",
    "__rxor__": "xor",
}


def func_name_of(func) -> str:
    """The raw name of a torch callable, as the user would write it (``__add__``, ``relu_``, ``T``)."""
    name = getattr(func, "__name__", None)
    if name is None:
        # Property getters arrive as ``Tensor.T.__get__``: the name lives on the property's getter.
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", None) or type(func).__name__
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", "get")
    return _without_namespace(func, name)


_BUILTIN_NAMESPACE = "torch._C._"


def _without_namespace(func, name: str) -> str:
    """The functions of ``torch.linalg``, ``torch.special`` and ``torch.fft`` are C builtins of
    ``torch._C._linalg`` (and so on) named with their namespace (``linalg_vector_norm``, ``special_erf``), but
    the user writes ``torch.linalg.vector_norm``, ``torch.special.erf``: the namespace is not part of the name."""
    module = getattr(func, "__module__", None)
    if type(module) is str and module.startswith(_BUILTIN_NAMESPACE):
        prefix = module[len(_BUILTIN_NAMESPACE):] + "_"
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    return name


def folded(name: str) -> str:
    """The spelling op types are compared in, so that ``layer_norm``, ``LayerNorm`` and ``layernorm`` name one
    type: lower case, without underscores."""
    return name.lower().replace("_", "")


@functools.lru_cache(maxsize=None)
def type_of_name(name: str) -> str:
    """Normalise a raw function name into the op type used in labels.  An operator overload called
    directly (``torch.ops.aten.add.Tensor``, named ``add.Tensor``) is its operator's type (``add``): a
    label holds no dot, which would read as a module address, and ``save=["add"]`` finds it."""
    name = name.partition(".")[0] or name
    if name in _REFLECTED_TO_FORWARD:
        return _REFLECTED_TO_FORWARD[name]
    return folded(name)


def op_label(op_type: str, type_index: int, layer_index: int) -> str:
    return f"{op_type}_{type_index}_{layer_index}"


def with_passes(layer_labels: list, pass_indices: list) -> list:
    """Each op's label: its layer's label and its pass (``linear_1_1:2``), over two columns."""
    return [f"{layer}:{p}" for layer, p in zip(layer_labels, pass_indices)]
