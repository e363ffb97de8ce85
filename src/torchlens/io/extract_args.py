"""What ``tl.extract`` is given, checked before the first batch runs, and how it reads a batch's arguments."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checks import LONGEST_WAIT_S, check_flag, check_number, check_takes
from ..errors import add_note
from ..progress import PROGRESS_ADVICE
from ..record.lookup import record_name_hint
from ..tree import as_args


def check_layers(layers) -> list:
    if isinstance(layers, str):
        layers = [layers]
    if not hasattr(layers, "__iter__"):
        raise TypeError(f"layers is a list of op labels or module addresses, e.g. ['fc', 'relu_1_2'], got "
                        f"{type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers must be a non-empty list of op labels or module addresses, e.g. ['fc', "
                         "'relu_1_2']")
    named = "each entry names one op per batch by its label or module address, e.g. ['fc', 'relu_1_2']"
    for name in layers:
        if not isinstance(name, str):  # a predicate, a module object: no fixed op to stack batch after batch
            raise TypeError(f"layers lists a {type(name).__name__} ({name!r:.60}); {named}{record_name_hint(name)}")
        if not name:
            raise ValueError(f"layers lists an empty name; {named}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers lists a name twice: {layers}")
    return layers


def check_options(kwargs, shard_bytes, progress, barrier_timeout, root) -> None:
    """The settings of every batch, checked before the first forward: ``shard_bytes="64MB"`` failed in ``int()``,
    ``"1000"`` and a negative size were taken, and a bad ``barrier_timeout`` failed only at the first barrier,
    after a rank's whole share."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"tl.extract: kwargs= is a dict of the keyword arguments every forward gets, got a "
                        f"{type(kwargs).__name__}; the batches' own arguments come from inputs (with args_of= or "
                        "kwargs_of=)")
    check_number(shard_bytes, "shard_bytes", "give the number of bytes to buffer before a shard is written (2**26 "
                 "for 64 MiB; 0 writes every batch)", who="tl.extract", at_least=0, finite=True)
    if progress is not None:
        check_flag(progress, "progress", PROGRESS_ADVICE, who="tl.extract")
    if root is not None and not isinstance(root, torch.nn.Module):  # it would be dropped: no module runs as it
        raise TypeError(f"tl.extract: root= is the nn.Module the callable runs, as for tl.trace, not "
                        f"{type(root).__name__}")
    check_number(barrier_timeout, "barrier_timeout", "give the seconds a finished rank waits for the others (1800 "
                 "by default)", who="tl.extract", at_least=1, finite=True, at_most=LONGEST_WAIT_S)
    if torch._C._functorch.peek_interpreter_stack() is not None:  # its tensors would be the transform's wrappers
        raise RuntimeError("tl.extract was called inside a torch.func transform (vmap, grad, ...), whose tensors are "
                           "the transform's wrappers, with no values a file can hold; call tl.extract outside the "
                           "transform")


def check_inputs(inputs) -> None:
    """``inputs`` is an iterable of batches.  A tensor iterates over its rows, each a sample without the batch
    dimension, which many models accept (a convolution runs an unbatched image): the rows' activations would be
    stacked as if each were a batch, a (10, 3, 8, 8) feature map read as 30 rows of (8, 8).  A dict iterates
    over its keys."""
    if isinstance(inputs, torch.Tensor):
        raise TypeError(f"inputs is an iterable of batches, and was given one tensor of shape {tuple(inputs.shape)}, "
                        "whose iteration gives its rows without their batch dimension: pass [x] for one batch, "
                        "x.split(n) for batches of n, a DataLoader, or x.unbind() if dimension 0 counts batches")
    if not hasattr(inputs, "__iter__"):
        raise TypeError(f"inputs is an iterable of batches (a list, a generator, a DataLoader), got "
                        f"{type(inputs).__name__}: pass [x] for one batch")
    if isinstance(inputs, Mapping):
        raise TypeError("inputs is an iterable of batches, and was given a dict, whose iteration gives its keys: "
                        "pass [batch] for one dict batch (with kwargs_of=dict for keyword arguments), or a list "
                        "or DataLoader of them")
    if unbatched_loader(inputs) and isinstance(inputs.dataset, (torch.Tensor, torch.utils.data.TensorDataset)):
        raise ValueError(f"inputs is a DataLoader made with batch_size=None over a {type(inputs.dataset).__name__}, "
                         "so it yields the dataset's rows one at a time, each without its batch dimension, which "
                         "tl.extract would store as if it were a batch; give the DataLoader a batch_size "
                         "(DataLoader(dataset, batch_size=32)), or pass the batches themselves (x.split(32))")


UNBATCHED_NOTE = ("tl.extract: inputs is a DataLoader made with batch_size=None, which yields each item of its "
                  "dataset as it is, not collated into batches: if the items are single examples, give the DataLoader "
                  "a batch_size (DataLoader(dataset, batch_size=32)), or pass the batches themselves")


def unbatched_loader(inputs) -> bool:
    """Whether ``inputs`` is a DataLoader made with ``batch_size=None`` (automatic batching off): each batch is one
    item of its dataset, a single example unless the dataset's items are batches already."""
    return isinstance(inputs, torch.utils.data.DataLoader) and inputs.batch_size is None \
        and inputs.batch_sampler is None


def batch_count(inputs):
    """How many batches ``inputs`` holds, for the progress bar's total; None where it cannot say: a generator, or a
    ``DataLoader`` over an ``IterableDataset`` without ``__len__`` (a streaming dataset), whose ``len()`` raises."""
    try:
        return len(inputs)
    except TypeError:
        return None


def batch_reader(args_of, kwargs_of, kwargs):
    """The function giving batch ``position``'s forward arguments as ``(args, its own kwargs)``.

    ``args_of(batch)`` (the batch itself by default, or nothing when only ``kwargs_of`` is given) follows
    ``tl.trace``'s input rule; ``kwargs_of(batch)`` must be a mapping, naming no argument ``kwargs`` (the
    keyword arguments of every forward) names too."""
    for option, given in (("args_of", args_of), ("kwargs_of", kwargs_of)):
        if given is not None and not callable(given):
            raise TypeError(f"{option}= takes a function of a batch (args_of=lambda batch: batch[0], kwargs_of=dict), "
                            f"got {type(given).__name__}; arguments that are the same for every batch go in kwargs=")
        if given is not None:
            check_takes(given, 1, f"tl.extract: {option} is called as {option}(batch), with each batch",
                        f"write it as {option}=lambda batch: ...")

    def arguments_of(batch, position):
        if args_of is not None:
            args = as_args(_called("args_of", args_of, batch, position))
        else:
            args = () if kwargs_of is not None else as_args(batch)
        if kwargs_of is None:
            return args, {}
        named = _called("kwargs_of", kwargs_of, batch, position)
        if not isinstance(named, Mapping):
            raise TypeError(f"batch {position}: kwargs_of returned {type(named).__name__}; it returns a dict of "
                            "keyword arguments for the forward (kwargs_of=dict for dict batches)")
        twice = sorted(set(named) & set(kwargs or ()))
        if twice:
            raise ValueError(f"batch {position}: kwargs_of and kwargs both give {', '.join(twice)}; give each "
                             "keyword argument one way")
        return args, dict(named)
    return arguments_of


def _called(option: str, function, batch, position: int):
    """``function(batch)``; an error it raises is noted with the batch it was given (``kwargs_of=dict`` given
    a tensor batch raised "dictionary update sequence element #0 has length 5; 2 is required", naming neither)."""
    try:
        return function(batch)
    except Exception as exc:
        add_note(exc, f"tl.extract: {option} raised on batch {position} (counting from 0), a {type(batch).__name__}"
                      + (": kwargs_of=dict takes batches that are dicts" if function is dict else ""))
        raise
