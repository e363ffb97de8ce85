"""Op type names and label formats.

The grammar follows the reference library so that its users can switch without relearning addresses:
an op's type is the torch function's name, lowercased, with dunder marks and every underscore removed
(``max_pool2d`` -> ``maxpool2d``, ``__getitem__`` -> ``getitem``, ``relu_`` -> ``relu``), and without the
overload of an operator called directly (``torch.ops.aten.add.Tensor`` -> ``add``).  Only the
commutative reflected operators map back to their forward name (``__radd__`` -> ``add``).
"""

from __future__ import annotations

import functools

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
    return name


@functools.lru_cache(maxsize=None)
def type_of_name(name: str) -> str:
    """Normalise a raw function name into the op type used in labels.  An operator overload called
    directly (``torch.ops.aten.add.Tensor``, named ``add.Tensor``) is its operator's type (``add``): a
    label holds no dot, which would read as a module address, and ``save=["add"]`` finds it."""
    name = name.partition(".")[0] or name
    if name in _REFLECTED_TO_FORWARD:
        return _REFLECTED_TO_FORWARD[name]
    return name.lower().replace("_", "")


def op_label(op_type: str, type_index: int, layer_index: int) -> str:
    return f"{op_type}_{type_index}_{layer_index}"


def with_pass(layer_label: str, pass_index: int) -> str:
    return f"{layer_label}:{pass_index}"


def with_passes(layer_labels: list, pass_indices: list) -> list:
    """``with_pass`` over two columns."""
    return [f"{layer}:{p}" for layer, p in zip(layer_labels, pass_indices)]
