"""JSON encoding of the non-tensor values a trace records (argument skeletons, output slots, positions).

Only plain data round-trips: numbers, strings, containers, slices, and the torch value types that are
named constants (dtype, device, Size, layout, memory_format).  Anything else (a custom object passed to
an op, a tensor nested where capture did not replace it) is stored as its type name and repr and comes
back as a ``NotSaved`` marker: visible, never mistaken for the original, and never executed.
A ``NotSaved`` marker (from a loaded trace being saved again) is written back as the record it was read
from, so a copy of a copy shows the original type and repr, not a marker wrapped in another.  An
``OutputSlot`` (record/saved_output.py) marks where an output tensor sat in the output's structure.
``unsavable`` says which tensors a safetensors file cannot hold (``tensorfile.write_tensors`` writes the rest).
"""

from __future__ import annotations

import math

import torch

from ..record.saved_output import OutputSlot
from ..tree import without_values
from .format import TRACE_JSON, TraceFileError

_MAX_DEPTH = 32
_TORCH_CONSTANT_TYPES = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


class NotSaved:
    """Stands in for an argument value that a saved trace could not store as data."""

    __slots__ = ("type_name", "text")

    def __init__(self, type_name: str, text: str):
        self.type_name = type_name
        self.text = text

    def __repr__(self) -> str:
        return f"<not saved: {self.type_name} {self.text}>"

    def __eq__(self, other):
        return isinstance(other, NotSaved) and (other.type_name, other.text) == (self.type_name, self.text)

    def __hash__(self):
        return hash((self.type_name, self.text))


def torch_constant_name(value) -> str:
    return str(value).replace("torch.", "")


def has_no_storage(t) -> bool:
    """Whether ``t`` is a tensor subclass with no storage of its own (a wrapper subclass, made with
    ``torch.Tensor._make_wrapper_subclass``): its values live in the tensors it wraps, out of a file's reach."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return True
    return False


# Why a tensor a trace held is not in a folder written with ``log.save(..., activations=False)``.
WITHOUT_ACTIVATIONS = "not saved: the trace was saved with activations=False"


def unsavable(t) -> str | None:
    """Why safetensors cannot hold tensor ``t`` (a sentence starting "not saved"), or None when it can."""
    if without_values(t):
        return ("not saved: a meta tensor has a shape and no values" if t.is_meta else
                "not saved: a fake tensor (FakeTensorMode) has a shape and no values")
    if has_no_storage(t):
        return f"not saved: a {type(t).__name__} tensor subclass has no plain storage to save"
    if t.layout != torch.strided:
        return f"not saved: {t.layout} tensors have no safetensors encoding"
    if t.is_quantized or t.is_nested:
        return "not saved: quantized and nested tensors have no safetensors encoding"
    if t.dtype not in _SAFETENSORS_DTYPES:
        return f"not saved: safetensors cannot store {torch_constant_name(t.dtype)}"
    return None


_SAFETENSORS_DTYPES = frozenset(getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"))


def torch_constant(kind: str, name: str):
    """``torch.<name>`` when it is a constant of the expected type; never anything callable."""
    expected = _TORCH_CONSTANT_TYPES[kind]
    named = isinstance(name, str) and name.isidentifier()
    value = getattr(torch, name, None) if named else None
    if named and value is None:  # a dtype a later torch added (saved where it was), or an edit
        raise TraceFileError(f"{TRACE_JSON}: torch {torch.__version__} has no {kind} {name!r}: the trace was saved "
                             "with a torch that has it, and loads where that torch is installed (or the file was "
                             "edited)")
    if not isinstance(value, expected):
        raise ValueError(f"{name!r} is not a torch {kind}")
    return value


def encode_value(obj, depth: int = 0):
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"$": "float", "v": repr(float(obj))}
    if isinstance(obj, complex):
        return {"$": "complex", "v": [encode_value(obj.real), encode_value(obj.imag)]}
    if isinstance(obj, torch.Size):
        return {"$": "size", "v": [int(d) for d in obj]}
    for kind, cls in _TORCH_CONSTANT_TYPES.items():
        if isinstance(obj, cls):
            return {"$": kind, "v": torch_constant_name(obj)}
    if isinstance(obj, torch.device):
        return {"$": "device", "v": str(obj)}
    if obj is Ellipsis:
        return {"$": "ellipsis"}
    if isinstance(obj, slice):
        return {"$": "slice", "v": [encode_value(obj.start, depth + 1), encode_value(obj.stop, depth + 1),
                                     encode_value(obj.step, depth + 1)]}
    if isinstance(obj, NotSaved):
        return {"$": "repr", "type": obj.type_name, "v": obj.text}
    if isinstance(obj, OutputSlot):
        return {"$": "output", "v": obj.index}
    if isinstance(obj, torch.Tensor):
        return {"$": "tensor", "type": "Tensor", "v": f"shape {list(obj.shape)} {torch_constant_name(obj.dtype)}"}
    if depth < _MAX_DEPTH:
        if type(obj) is list:
            return [encode_value(o, depth + 1) for o in obj]
        if type(obj) is tuple:
            return {"$": "tuple", "v": [encode_value(o, depth + 1) for o in obj]}
        if type(obj) is dict:
            return {"$": "dict",
                    "v": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in obj.items()]}
    return {"$": "repr", "type": type(obj).__name__, "v": _short_repr(obj)}


def _short_repr(obj) -> str:
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not stop a save
        text = "<repr failed>"
    return text if len(text) <= 200 else text[:197] + "..."


def decode_value(obj, depth: int = 0):
    if depth > _MAX_DEPTH + 2:
        raise ValueError("values nested deeper than any saved trace writes")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode_value(o, depth + 1) for o in obj]
    if not isinstance(obj, dict) or not isinstance(obj.get("$"), str):
        raise ValueError(f"unexpected value {str(obj)[:80]}")
    tag, v = obj["$"], obj.get("v")
    if tag == "float":
        if v not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad float {v!r}")
        return float(v)
    if tag == "complex":
        return complex(_number(v[0]), _number(v[1]))
    if tag == "size":
        return torch.Size([int(_number(d)) for d in v])
    if tag in _TORCH_CONSTANT_TYPES:
        return torch_constant(tag, v)
    if tag == "device":
        return torch.device(_string(v))
    if tag == "ellipsis":
        return Ellipsis
    if tag == "slice":
        start, stop, step = (decode_value(x, depth + 1) for x in v)
        return slice(start, stop, step)
    if tag == "tuple":
        return tuple(decode_value(o, depth + 1) for o in v)
    if tag == "dict":
        return {_hashable(decode_value(k, depth + 1)): decode_value(x, depth + 1) for k, x in v}
    if tag == "output":
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"bad output slot {v!r}")
        return OutputSlot(v)
    if tag in ("repr", "tensor"):
        return NotSaved(_string(obj.get("type")), _string(v))
    raise ValueError(f"unknown value tag {tag!r}")


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float, dict)):
        raise ValueError(f"expected a number, got {v!r}")
    return decode_value(v) if isinstance(v, dict) else v


def _string(v) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def _hashable(key):
    hash(key)  # a list key (from a corrupted file) raises TypeError here, reported by the loader
    return key
