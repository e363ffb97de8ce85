"""The output of a loaded trace, rebuilt from its saved output tensors and their paths.

A saved trace holds each returned tensor with the path it sat at (``output``, ``output.0``,
``output.logits``) but not the Python objects around them.  The rebuild nests plain containers along
those paths: a tuple where every key is a position, a dict otherwise (a ``ModelOutput`` comes back as
a dict of its tensor fields).  Non-tensor parts of the original output were never saved.
"""

from __future__ import annotations

from ..errors import ActivationUnavailable


def rebuild_output(trace):
    leaves = []
    for op in trace.outputs:
        try:
            tensor = op.activation
        except ActivationUnavailable as exc:
            raise ActivationUnavailable(f"log.output is rebuilt from the saved output tensors, and {exc}") from None
        if tensor is None:
            raise ActivationUnavailable(f"this trace was loaded from {trace.loaded_from} and its output "
                                        f"{op.io_path} was saved without its activation: save with "
                                        "save='all' (or list the output) to read log.output")
        leaves.append((op.io_path.split(".")[1:], tensor))
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]
    root: dict = {}
    for keys, tensor in leaves:
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = tensor
    return _containers(root)


def _containers(node):
    if not isinstance(node, dict):
        return node
    items = {key: _containers(value) for key, value in node.items()}
    if items and all(key.isdigit() for key in items) and sorted(map(int, items)) == list(range(len(items))):
        return tuple(items[str(i)] for i in range(len(items)))
    return items
