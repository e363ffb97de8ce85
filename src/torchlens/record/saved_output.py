"""The output of a loaded trace, rebuilt from its saved output tensors and the output's saved structure.

A saved trace holds each returned tensor as an output op, and the structure around them: lists, tuples
and dicts as they were (a ``None`` slot, a key with a dot in it, a list that is not a tuple), with an
``OutputSlot`` where each tensor sat and the plain values (numbers, strings, ``None``) in their places.
What cannot be saved as data comes back in its plainest form: a ``ModelOutput``, a dataclass or another
object holding tensors as a dict of its fields, a named tuple as a tuple, and any other value as the
``NotSaved`` marker the file holds for it.

A trace saved before the structure was kept holds the output paths only (``output.0``,
``output.a.b``), which do not say whether a level was a list or a tuple, or where a key's dots were, so
its output is rebuilt only when it is a single tensor; otherwise reading it raises, naming the tensors
to read instead.
"""

from __future__ import annotations

from ..errors import ActivationUnavailable, TorchlensError, listed
from ..tree import MAX_DEPTH, container_items, tensor_leaves


class OutputSlot:
    """Where the ``index``-th output tensor sat in the value the forward returned."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __eq__(self, other):
        return isinstance(other, OutputSlot) and other.index == self.index

    def __hash__(self):
        return hash(("OutputSlot", self.index))

    def __repr__(self) -> str:
        return f"OutputSlot({self.index})"


def output_structure(output):
    """``output`` with each tensor replaced by its ``OutputSlot`` (numbered as ``log.outputs`` are: in the
    order capture walked the output), and every container made a list, tuple or dict."""
    slots = {path: OutputSlot(k) for k, (path, _) in enumerate(tensor_leaves(output, attrs=True))}
    # Every path with a tensor below it, gathered once: asking each container whether a slot lies below it
    # read every slot per container (a list of n cache layers, each an object holding its tensors: n * n).
    holders = {path[:end] for path in slots for end in range(len(path))}
    return _structure(output, (), slots, holders, 0)


def _structure(value, path: tuple, slots: dict, holders: set, depth: int):
    if path in slots:
        return slots[path]
    if depth >= MAX_DEPTH:
        return value  # not walked by capture either; saved as its repr
    if type(value) is list:
        return [_structure(v, path + (i,), slots, holders, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):  # a named tuple too: its class is code, not data
        return tuple(_structure(v, path + (i,), slots, holders, depth + 1) for i, v in enumerate(value))
    children = container_items(value, attrs=path in holders)
    if children is None:
        return value
    return {key: _structure(v, path + (key,), slots, holders, depth + 1) for key, v in children}


def rebuild_output(trace):
    """The loaded trace's output: its saved structure with each output tensor put back in its slot."""
    if trace.stopped_after is not None:
        return None  # the forward was stopped by stop_after= and returned nothing, as the live trace says
    tensors = [_output_tensor(trace, op) for op in trace.outputs]
    if trace._output_structure is None:
        return _rebuild_from_paths(trace, tensors)
    return _fill(trace._output_structure[0], tensors)


def _output_tensor(trace, op):
    try:
        tensor = op.activation
    except ActivationUnavailable as exc:
        raise ActivationUnavailable(f"log.output is rebuilt from the saved output tensors, and {exc}") from None
    if tensor is None:
        raise ActivationUnavailable(f"this trace was loaded from {trace.loaded_from} and its output "
                                    f"{op.io_path} was saved without its activation: save with "
                                    "save='all' (or list the output) to read log.output")
    return tensor


def _fill(structure, tensors: list):
    if isinstance(structure, OutputSlot):
        return tensors[structure.index]
    if type(structure) is list:
        return [_fill(v, tensors) for v in structure]
    if type(structure) is tuple:
        return tuple(_fill(v, tensors) for v in structure)
    if type(structure) is dict:
        return {key: _fill(v, tensors) for key, v in structure.items()}
    return structure


def _rebuild_from_paths(trace, tensors: list):
    """A file without the output's structure: only a lone tensor is known for sure."""
    outputs = trace.outputs
    if len(outputs) == 1 and outputs[0].io_path == "output":
        return tensors[0]
    paths = listed([op.io_path for op in outputs], 6)
    raise TorchlensError(f"this trace was loaded from {trace.loaded_from}, saved by a torchlens that kept the "
                         "output's tensors but not the containers around them, so log.output cannot be rebuilt "
                         f"faithfully; read each tensor as log.outputs[k].activation (paths: {paths})")
