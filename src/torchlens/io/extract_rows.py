"""Which rows ``tl.extract`` stacks: a batch's size, read from its inputs, and each layer's batch dim.

A layer is stored as one array with a row per example, so each batch's activation is split along its batch
dim: dim 0 unless ``batch_dim=`` names another for that layer (transformers' gemma3n keeps its altup
streams as ``(altup_num_inputs, B, S, H)``), in which case that dim is moved to the front.  The batch size
is read from the inputs (``batch_dimension``): dim 0 of the first input whose dim 0 is not 1 (later, of the
input earlier batches were counted by), or the dim ``input_batch_dim=`` names (1 for a sequence-first model's
``(S, B, E)`` inputs); every layer's batch dim must have it, batch after batch: a dim that does not follow the
batch size is refused, naming the layer, its shape and the batch size.

What no check can see is a dim that has the batch's size by coincidence in every batch: gemma3n's
``(2, B, S, H)`` at ``B = 2`` has the shape a batch-major layer of rows ``(2, S, H)`` would have.  Batches of
different sizes expose it (the first batch of another size is refused); otherwise only the user knows
which dim is the batch, which is what ``batch_dim=`` says.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..checks import check_int
from ..record.layouts import shape_of, shape_text
from ..tree import path_text, tensor_leaves


def check_batch_dim(batch_dim, layers: list) -> dict:
    """``{layer: its batch dim}`` for the layers ``batch_dim=`` gives a dim other than 0 (``{}`` when every
    layer's is dim 0, the default), checked before the first batch runs."""
    if batch_dim is None:
        return {}
    example = f"batch_dim={{{layers[0]!r}: 1}}"
    if not isinstance(batch_dim, Mapping):
        raise TypeError(f"tl.extract: batch_dim= maps a layer to its batch dim when that is not dim 0 ({example}), "
                        f"got {type(batch_dim).__name__}")
    for name, dim in batch_dim.items():
        if name not in layers:
            raise ValueError(f"tl.extract: batch_dim= names {name!r}, which layers= does not list ({layers}); "
                             "name the layers as layers= does")
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"tl.extract: batch_dim[{name!r}] is {dim!r}, not a dim; give the index of the layer's "
                            f"batch dim ({example})")
    return {name: dim for name, dim in batch_dim.items() if dim != 0}


def check_input_batch_dim(input_batch_dim) -> int:
    """The inputs' batch dim, ``input_batch_dim=``: a dim index, 0 unless the inputs are sequence-first."""
    return int(check_int(input_batch_dim, "input_batch_dim", "give the dim of the inputs that counts the batch's "
                         "examples (1 for sequence-first inputs of shape (S, B, E))", who="tl.extract", at_least=0))


def batch_dimension(args, named=None, dim: int = 0, source=None) -> tuple:
    """``(rows, where they were read, ragged advice, source)``: dim ``dim`` (``input_batch_dim=``) of the input
    ``source`` (``(root, path)``, the input earlier batches' sizes were read from), when this batch has it; else of
    the first input tensor, positional then keyword, that has the dim and whose size there is not 1.  An input of
    one row is taken to broadcast over the batch (an attention mask of shape (1, S), transformers'
    ``position_ids``), so it decides the count only when every input has one row; but a last batch of one example
    is still counted by the input that counted the others, not by another input that has no batch dim."""
    leaves = [(root, path, t) for root, value in (("args", args), ("kwargs", named)) if value
              for path, t in tensor_leaves(value) if t.dim()]
    if not leaves:
        return None, None, "", None
    # A nested tensor's shape is read as shape_of reads it (a strided one raises on .shape); a dim whose size
    # differs between its components counts no examples.
    wide = [(root, path, t, shape_of(t)[dim]) for root, path, t in leaves if t.dim() > dim]
    if not wide:  # named explicitly, so the batch cannot be guessed from another dim
        raise ValueError(f"input_batch_dim={dim}, but no input tensor has a dim {dim} (their shapes: "
                         f"{[tuple(shape_of(t)) for _, _, t in leaves]}); give the dim of the inputs that counts the "
                         "batch's examples")
    if all(size is None for *_, size in wide):
        raise ValueError(f"input_batch_dim={dim}, but the sizes of dim {dim} differ between the components of each "
                         f"nested input tensor (their shapes: {[shape_text(shape_of(t)) for _, _, t, _ in wide]}), so "
                         "it counts no examples; give the dim of the inputs that counts the batch's examples")
    wide = [leaf for leaf in wide if leaf[3] is not None]
    earlier = next((leaf for leaf in wide if (leaf[0], leaf[1]) == source), None)
    root, path, _, rows = earlier or next((leaf for leaf in wide if leaf[3] != 1), wide[0])
    how = "the input earlier batches' sizes were read from" if earlier else f"the first input whose dim {dim} is not 1"
    return (rows, f"dim {dim} of the input {path_text(root, path)}, {how}", _ragged_advice(root, path, dim, wide),
            (root, path))


def _ragged_advice(root: str, path: tuple, dim: int, leaves: list) -> str:
    """What ``rows_first``'s refusal advises when the batch size was read from one of a list of tensors whose sizes
    differ there (ragged sequences, a tensor per example), whose examples no tensor's dim counts; "" otherwise.
    ``leaves``: ``(root, path, tensor, its size in the batch dim)``."""
    sizes = {size for r, p, _, size in leaves if r == root and len(p) == len(path) >= 2 and p[:-1] == path[:-1]}
    if len(sizes) < 2:
        return ""
    return (f"that input is one of the tensors of {path_text(root, path[:-1])}, whose dim {dim} sizes differ (ragged "
            "sequences, a tensor per example?): a batch's size is read from a tensor's dim, never from a list's "
            "length, so give each batch's examples as one tensor, batch dim first (the sequences padded to one "
            "length, with a mask or their lengths)")


def rows_first(name: str, label: str, t, dim: int, batch: tuple, position: int, earlier_rows=None):
    """``t`` with its batch dim ``dim`` first, once that dim is checked to have the ``batch``'s size (``(rows,
    the input they were read from)``; rows None when the batch has no tensor).  ``earlier_rows``: the shape of one
    row of this layer in earlier batches (None before the first), which passed this check, by coincidence when this
    one fails it."""
    shape = tuple(t.shape)
    rows, rows_from, ragged = batch[:3]
    if rows == 1 and earlier_rows is not None and list(shape) == list(earlier_rows):
        raise ValueError(_dropped_batch_dim(name, label, shape, position, rows_from))
    if t.dim() == 0:
        raise ValueError(f"batch {position}: {name} ({label}) is a scalar; extraction stacks activations along their "
                         f"batch dim{_one_example_note(rows)}")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"batch_dim= gives {name} ({label}) the batch dim {dim}, but its activation has shape "
                         f"{shape}, of {t.dim()} dims; give the index of the dim that counts its rows")
    dim %= t.dim()
    if rows is not None and t.shape[dim] != rows:
        advice = ragged or (f"tl.extract stores a row per example, so dim {dim} is not this layer's batch dim. "
                            f"{_what_to_do(name, shape, dim, rows, earlier_rows is not None)}")
        raise ValueError(f"batch {position}: {name} ({label}) has shape {shape}, whose batch dim {dim} has "
                         f"{t.shape[dim]} entries, but the batch has {rows} rows ({rows_from}): {advice}")
    return t if dim == 0 else t.movedim(dim, 0).contiguous()


def _dropped_batch_dim(name: str, label: str, shape: tuple, position: int, rows_from: str) -> str:
    """The refusal for a batch of one example whose activation has the shape of one row of the earlier batches:
    the forward dropped the batch dim because its size was 1 (``squeeze()`` with no dim), the usual fate of a
    DataLoader's odd last batch.  Its one row is not stacked as if it were the example: the dim it lacks is a
    guess, and the earlier batches' rows are examples, not the coincidence ``_what_to_do`` warns of."""
    return (f"batch {position} has one example ({rows_from}), and {name} ({label}) has shape {shape}, the shape of "
            "one row of the earlier batches, with no batch dim: the forward dropped the batch's dim because its size "
            "is 1 (squeeze() with no dim squeezes it too). Squeeze only the dims you mean (x.squeeze(-1)), or leave "
            "the batch of one out (DataLoader(..., drop_last=True))")


def _one_example_note(rows) -> str:
    """A scalar in a batch of one example is usually a row whose batch dim ``squeeze()`` dropped: say so."""
    if rows != 1:
        return ""
    return (" (this batch has one example: a squeeze() with no dim drops its batch dim of size 1 too; squeeze only "
            "the dims you mean)")


def _what_to_do(name: str, shape: tuple, dim: int, rows: int, matched_before: bool) -> str:
    """The advice closing ``rows_first``'s refusal: the dims that have the batch's size, if any, and, when earlier
    batches passed, that their rows are not examples either."""
    sized = [k for k, size in enumerate(shape) if size == rows and k != dim]
    if not sized:
        advice = ("None of its dims has the batch's size: choose a layer with a row per example (a value computed "
                  "over the whole batch has none)")
    elif len(sized) == 1:
        advice = f"Its dim {sized[0]} has the batch's size: pass batch_dim={{{name!r}: {sized[0]}}} if it is the batch"
    else:
        advice = (f"Its dims {', '.join(map(str, sized))} have the batch's size: pass batch_dim={{{name!r}: <the batch "
                  "dim>}")
    if matched_before:
        advice += (f". Earlier batches passed only because dim {dim} had their size by coincidence, so their rows are "
                   "not examples either: extract again into a new folder, or delete this one")
    return advice
