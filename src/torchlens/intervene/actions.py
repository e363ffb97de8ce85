"""What an intervention does to the tensor at its site: the helpers ``tl.zero_ablate()`` and friends.

An action is called as ``action(tensor, op)`` where the site's value is produced and returns the value
downstream ops see instead (``None`` keeps it).  Every helper computes out of place, so the value the
model made is never written; ``at=`` restricts a helper to ``tensor[at]`` (one attention head, one
position) and leaves the rest of the tensor as it was.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from ..checks import check_int, check_number, check_takes
from ..errors import ReplacementMismatch, refuse_unknown_keywords
from ..record.layouts import shape_of
from ..record.trace import checked_trace
from ..capture.teardown import restore_torch_function_state, torch_function_state
from ..tree import TENSOR_TYPES

# What a helper reading another run takes: a trace of a run taking the same path, with its site saved.
_SOURCE_TRACE = "tl.trace(model, x) of a run taking the same path, with the site's activation saved"

_SCALAR_PROBE = torch.zeros(())  # multiplied by a helper's number once, when the helper is made
_PLAIN_NUMBERS = frozenset([int, float, complex])
_INDEX_TYPES = (numbers.Integral, slice, type(Ellipsis), tuple, list, torch.Tensor)  # what tensor[at] takes


class Action:
    """Base class of the helpers: ``value`` computes the new value of ``tensor[at]`` (or the whole)."""

    def __init_subclass__(cls, **kwargs):
        # Python's refusal of an unknown keyword names __init__ alone ("scale.__init__() got an unexpected keyword
        # argument 'atx'"), with no hint of what the helper takes.  Wrapped, not checked in __new__, whose
        # (*args, **kwargs) help() and inspect.signature would show in place of the helper's own options.
        super().__init_subclass__(**kwargs)
        cls.__init__ = _keywords_checked(cls.__init__)

    def __init__(self, at=None):
        if at is not None and not isinstance(at, _INDEX_TYPES) or isinstance(at, bool):
            raise TypeError(f"tl.{type(self).__name__}: at= takes an index of the value (an int, a slice, a tuple of "
                            f"them such as (slice(None), 3), or a list or tensor of indices), got "
                            f"{type(at).__name__} {at!r}")
        self.at = at

    def __call__(self, tensor: torch.Tensor, op):
        try:
            if self.at is None:
                return self.value(tensor, op, None)
            new = tensor.clone()
            try:
                new[self.at] = self.value_at(tensor, op)
            except IndexError as exc:  # named with the site, not left to torch (after value_at's own checks)
                raise ReplacementMismatch(f"{self!r} at {_where(op)}: at={self.at!r} is outside this value of shape "
                                          f"{tuple(tensor.shape)} ({exc})") from exc
            return new
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            plain = tensor.layout == torch.strided and not (tensor.is_nested or tensor.is_quantized
                                                            or tensor.is_complex())
            # NotImplementedError is a RuntimeError that says torch has no kernel for this value's dtype (a float8
            # dtype has few on the CPU), which no argument of the helper's can change.
            if plain and not isinstance(exc, NotImplementedError):
                if isinstance(exc, RuntimeError):  # a tensor argument of the helper's that the value cannot take
                    raise ReplacementMismatch(
                        f"{self!r} at {_where(op)}: torch could not compute it on {self._part_shown(tensor)} "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); give arguments that fit it (a "
                        f"tensor argument must broadcast to its shape{_of_its_kind(tensor, exc)})") from exc
                raise
            # torch has no kernel for much of what a helper computes on sparse, nested, quantized and complex values
            # (complex numbers have no order to clamp in), nor for some dtypes: named with the helper and the site
            # rather than left as torch's own message.
            kind = str(tensor.dtype).replace("torch.", "") if plain or tensor.is_complex() else layout_name(tensor)
            where = "has a dtype torch computes it on" if plain else "is a real, dense tensor"
            raise ReplacementMismatch(f"{self!r} at {_where(op)}: torch cannot compute it on this {kind} value "
                                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); write the "
                                      "action as a function of the tensor (lambda t, op: ...), or intervene where "
                                      f"the value {where}") from exc

    def _part_shown(self, tensor: torch.Tensor) -> str:
        """What the helper computed on, for a refusal: the value, or with ``at=`` the part of it its tensor
        arguments broadcast to."""
        whole = f"this value of shape {tuple(tensor.shape)}"
        if self.at is None:
            return whole
        try:
            return f"value[at] of shape {tuple(tensor[self.at].shape)}, in {whole}"
        except (IndexError, RuntimeError, TypeError):
            return whole

    def value(self, tensor: torch.Tensor, op, at):
        raise NotImplementedError

    def value_at(self, tensor: torch.Tensor, op) -> torch.Tensor:
        """The new value of ``tensor[at]``: the helper's value of that part alone, which for an elementwise
        helper is the part of its value of the whole."""
        return self.value(tensor[self.at], op, self.at)

    def _describe(self) -> str:
        return ""

    def __repr__(self) -> str:
        parts = [p for p in (self._describe(), f"at={_shown(self.at)}" if self.at is not None else "") if p]
        return f"{type(self).__name__.lstrip('_')}({', '.join(parts)})"


def _keywords_checked(init):
    """``init``, refusing a keyword it does not take in the helper's name, with what it takes and the closest."""
    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        refuse_unknown_keywords(f"tl.{type(self).__name__}", kwargs, init, given=1)
        init(self, *args, **kwargs)
    return checked


_SHOWN_ELEMENTS = 8  # the most elements a helper's repr prints of a tensor argument


def _shown(value) -> str:
    """An argument of a helper as its repr shows it: a tensor of more than a few elements by its shape
    (``tensor(6, 32)``), as ``replace_with`` shows its tensor, where its own repr printed rows of numbers into
    ``log.interventions``, a saved trace and every refusal naming the helper; an index tuple element by element."""
    if isinstance(value, tuple):
        return f"({', '.join(map(_shown, value))}{',' if len(value) == 1 else ''})"
    if isinstance(value, torch.Tensor) and value.numel() > _SHOWN_ELEMENTS:
        return f"tensor{tuple(value.shape)}"
    return repr(value)


class zero_ablate(Action):  # noqa: N801 - lower case: used like a function, tl.zero_ablate()
    """Replace the value with zeros.  With ``at=`` (an index: ``at=1``, ``at=(slice(None), 3)``), only
    ``value[at]`` changes."""

    def value(self, tensor, op, at):
        return torch.zeros_like(tensor)


class scale(Action):  # noqa: N801
    """Multiply the value by ``k``.  With ``at=`` (an index: ``at=1``, ``at=(slice(None), 3)``), only
    ``value[at]`` changes."""

    def __init__(self, k, at=None):
        super().__init__(at)
        self.k = _number("tl.scale", "k", k)

    def value(self, tensor, op, at):
        return _in_dtype(tensor * _operand(self, "k", self.k, tensor, op), tensor)

    def _describe(self):
        return _shown(self.k)


class clamp(Action):  # noqa: N801
    """Clamp the value into ``[min, max]`` (either bound may be None).  With ``at=`` (an index: ``at=1``,
    ``at=(slice(None), 3)``), only ``value[at]`` changes."""

    def __init__(self, min=None, max=None, at=None):  # noqa: A002 - torch.clamp's names
        super().__init__(at)
        if min is None and max is None:
            raise ValueError("tl.clamp needs min, max or both")
        self.min = None if min is None else _number("tl.clamp", "min", min)
        self.max = None if max is None else _number("tl.clamp", "max", max)
        _check_bounds_ordered(self.min, self.max)

    def value(self, tensor, op, at):
        low, high = (None if b is None else _operand(self, name, b, tensor, op)
                     for name, b in (("min", self.min), ("max", self.max)))
        if low is not None and high is not None and isinstance(low, torch.Tensor) != isinstance(high, torch.Tensor):
            # torch.clamp takes two numbers or two tensors, and refuses one of each: the number becomes a tensor
            low, high = (b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=tensor.dtype, device=tensor.device)
                         for b in (low, high))
        return _in_dtype(tensor.clamp(low, high), tensor)

    def _describe(self):
        return f"min={_shown(self.min)}, max={_shown(self.max)}"


class steer(Action):  # noqa: N801
    """Add ``scale * vector`` along dimension ``dim`` (the last by default), broadcast over the others.
    ``dim`` is a dimension of the whole value, also with ``at=``, which only picks the part changed."""

    def __init__(self, vector, scale=1.0, dim: int = -1, at=None):
        super().__init__(at)
        if not isinstance(vector, torch.Tensor):
            raise TypeError(f"tl.steer: vector= takes a 1-d tensor, the direction to add along one dimension, got "
                            f"{type(vector).__name__} (torch.tensor(...) makes one)")
        if vector.dim() != 1:
            raise ValueError(f"tl.steer needs a 1-d tensor: the direction to add along one dimension, got "
                             f"{vector.dim()}-d {tuple(vector.shape)}")
        _int("tl.steer", "dim", dim)
        self.vector, self.scale, self.dim = vector, _number("tl.steer", "scale", scale), dim

    def value(self, tensor, op, at):
        _check_dims(self, (self.dim,), tensor, op)
        dim = self.dim % tensor.dim()
        if tensor.shape[dim] != self.vector.numel():
            raise ReplacementMismatch(f"tl.steer at {_where(op)}: the vector has {self.vector.numel()} entries but "
                                      f"dimension {self.dim} of the value (of shape {tuple(tensor.shape)}) has "
                                      f"{tensor.shape[dim]}; give a vector of that length, or dim= the dimension to "
                                      "steer along")
        # Before the dtype check, whose advice (a vector of the value's dtype) a mask would refuse in turn.
        if tensor.dtype == torch.bool:  # True + True is 2, which a mask cannot hold
            raise ReplacementMismatch(f"{self!r} at {_where(op)}: the value is a torch.bool mask, to which nothing "
                                      "can be added; tl.zero_ablate, tl.clamp, tl.patch_from or a bool tensor can "
                                      "change it")
        _castable(self.vector, tensor, op, "tl.steer's vector")
        shape = [1] * tensor.dim()
        shape[dim] = -1
        vector = self.vector.to(device=tensor.device, dtype=tensor.dtype).reshape(shape)
        return tensor + _operand(self, "scale", self.scale, tensor, op) * vector

    def value_at(self, tensor, op):
        return self.value(tensor, op, None)[self.at]  # ``dim`` names a dimension of the whole value

    def _describe(self):
        return f"vector[{self.vector.numel()}], scale={self.scale!r}" + (f", dim={self.dim}" if self.dim != -1 else "")


class noise(Action):  # noqa: N801
    """Add Gaussian noise of standard deviation ``std`` (drawn from ``generator``, else the global RNG).
    With ``at=`` (an index: ``at=1``, ``at=(slice(None), 3)``), only ``value[at]`` changes."""

    def __init__(self, std, generator=None, at=None):
        super().__init__(at)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"tl.noise: generator= takes a torch.Generator or None, got {type(generator).__name__}")
        # A negative or infinite spread is a slip (-0.1 for 0.1; inf would make every value infinite).
        self.std = std if isinstance(std, torch.Tensor) else \
            check_number(std, "std", "give a standard deviation, a finite number 0 or more, or a tensor of them",
                         who="tl.noise", at_least=0, finite=True)
        self.generator = generator

    def value(self, tensor, op, at):
        _needs_float(self, tensor, op)
        drawn = torch.randn(tensor.shape, generator=self.generator, dtype=tensor.dtype, device=tensor.device)
        return tensor + _operand(self, "std", self.std, tensor, op) * drawn

    def _describe(self):
        return f"std={_shown(self.std)}"


class patch_from(Action):  # noqa: N801
    """The value at the same site in another trace (activation patching: run on a corrupted input,
    patch in the clean run's value).  That trace must hold the activation (``save="all"`` or a ``save=``
    list naming the site), of the shape of the value it replaces.  With ``at=`` (an index), only ``value[at]``
    is patched, from the same index of that trace's value."""

    def __init__(self, trace, at=None):
        super().__init__(at)
        self.trace = checked_trace(trace, "tl.patch_from: trace=", _SOURCE_TRACE)

    def value(self, tensor, op, at):
        return _like(_checked_same_shape(source_value(self.trace, op, "tl.patch_from"), tensor, op), tensor, op,
                     "tl.patch_from")

    def value_at(self, tensor, op):
        """``source[at]``, from a source of the whole value's shape: index ``at`` of a run of another length
        is not the same place in it."""
        source = _checked_same_shape(source_value(self.trace, op, "tl.patch_from"), tensor, op)
        return _like(source[self.at], tensor[self.at], op, "tl.patch_from")

    def _describe(self):
        return f"<trace of {self.trace.model_name}>"


class mean_ablate(Action):  # noqa: N801
    """Replace the value with its mean over ``dims`` (the batch, dim 0, by default), broadcast back to its
    shape; with ``trace=``, the mean of the value at the same site in that trace instead.  ``dims`` are
    dimensions of the whole value, also with ``at=``, which only picks the part replaced: ``at=1`` puts the
    batch mean in row 1."""

    def __init__(self, dims=0, trace=None, at=None):
        super().__init__(at)
        for dim in _as_tuple(dims):
            _int("tl.mean_ablate", "dims", dim)
        if len(set(_as_tuple(dims))) != len(_as_tuple(dims)):  # torch refuses it mid-forward
            raise ValueError(f"tl.mean_ablate: dims={dims!r} names a dimension twice; name each once")
        if isinstance(dims, (tuple, list)) and not dims:  # torch reads no dimension as every dimension
            raise ValueError(f"tl.mean_ablate: dims={dims!r} names no dimension, which torch's mean reads as every "
                             "dimension; name the dimensions to average over, or give dims=None for the mean of "
                             "the whole value")
        if trace is not None:
            checked_trace(trace, "tl.mean_ablate: trace=", _SOURCE_TRACE)
        self.dims, self.trace = dims, trace

    def value(self, tensor, op, at):
        _check_dims(self, _as_tuple(self.dims), tensor, op)
        _needs_float(self, tensor, op)
        source = tensor if self.trace is None else \
            _checked_holds_values(self, _checked_kept_dims(self, source_value(self.trace, op, "tl.mean_ablate"),
                                                           tensor, op), op)
        mean = source.float().mean(dim=self.dims, keepdim=True) if not (source.is_floating_point() or
                                                                         source.is_complex()) \
            else source.mean(dim=self.dims, keepdim=True)
        return _like(mean, tensor, op, "tl.mean_ablate's mean")

    def value_at(self, tensor, op):
        return self.value(tensor, op, None)[self.at]  # ``dims`` are dimensions of the whole value

    def _describe(self):
        return f"dims={self.dims!r}" + (", trace=<trace>" if self.trace is not None else "")


class replace_with(Action):  # noqa: N801
    """A tensor given as the action: the value is replaced by (a copy of) it, broadcast to the shape."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__(None)
        self.tensor = tensor

    def value(self, tensor, op, at):
        return _like(self.tensor, tensor, op, "a replacement tensor")

    def _describe(self):
        return f"tensor{tuple(self.tensor.shape)}"


def as_action(action):
    """The callable a site runs: helpers and callables as they are, a tensor as a replacement."""
    if isinstance(action, torch.Tensor):
        return replace_with(action)
    if isinstance(action, type):  # callable too, but called as action(tensor, op) it would build an object
        helper = issubclass(action, Action)
        raise TypeError(f"an intervention action got the {'helper' if helper else 'class'} {action.__name__} "
                        + (f"uncalled: call it, tl.{action.__name__}(...), to make the action" if helper else
                           "itself: an action is a callable f(tensor, op), a tensor or a helper such as "
                           "tl.zero_ablate()"))
    if callable(action):
        if not isinstance(action, Action):
            _check_takes_tensor_and_op(action)
        return action
    raise TypeError(f"an intervention action must be a callable f(tensor, op), a tensor or a helper such as "
                    f"tl.zero_ablate(); got {type(action).__name__}")


def _check_takes_tensor_and_op(action) -> None:
    """An action is called as ``action(tensor, op)``: one that cannot take those two arguments
    (``lambda t: t * 0``) is refused before any run rather than failing inside the forward."""
    check_takes(action, 2, "an intervention action is called as action(tensor, op), with the site's value and its op",
                "write it as lambda tensor, op: ... (ignore op when not needed)")


def _number(who: str, name: str, value):
    """``value`` when it is a tensor (what torch's arithmetic takes) or a number other than NaN; otherwise refused
    when the helper is made, not at its first site, mid-forward."""
    if isinstance(value, torch.Tensor):
        return value
    check_number(value, name, "give a float, an int or a tensor", who=who, complex_ok=True)
    if not _torch_computes_with(value):  # a Fraction: it would fail at the helper's first site, mid-forward
        raise TypeError(f"{who}: {name}={value!r} is a {type(value).__name__}, which torch cannot compute with; give "
                        f"a float, an int or a tensor (float({name}))")
    return value


def _torch_computes_with(value) -> bool:
    """Whether torch's arithmetic takes the number ``value``.  The plain types need no check; any other (a numpy
    scalar, a Fraction) is multiplied by a tensor once, with torch functions off: a helper made inside a traced
    forward must record no op of its own."""
    if type(value) in _PLAIN_NUMBERS:
        return True
    torch_functions = torch_function_state()
    try:
        with torch._C.DisableTorchFunction():
            _SCALAR_PROBE * value
        return True
    except TypeError:
        return False
    finally:  # put back by hand as well: an interrupt as the block exits would skip the context's own exit
        restore_torch_function_state(torch_functions)


def _int(who: str, name: str, value) -> None:
    check_int(value, name, "give a dimension (an int, or for dims= a tuple of ints)", who=who)


def _check_bounds_ordered(low, high) -> None:
    """torch.clamp with min above max sets every value to max, which is no clamp into a range."""
    if isinstance(low, numbers.Real) and isinstance(high, numbers.Real) and low > high:
        raise ValueError(f"tl.clamp: min={low!r} is above max={high!r}, so every value would become {high!r}; give "
                         "min <= max (or tl.clamp(max=...) alone to cap values)")


def source_value(trace, op, who: str) -> torch.Tensor:
    """The activation another trace holds at the site ``op`` stands for."""
    label = op.label
    found = None
    output_index = getattr(op, "output_index", None)
    if output_index is not None:  # a module site: that call's output tensor number ``output_index``
        call = next((mc for mc in trace.module_calls if mc.label == label), None)
        if call is not None and output_index < len(call._output_nodes) and call._output_nodes[output_index] >= 0:
            found = trace.ops[call._output_nodes[output_index]]
    elif label in trace:
        found = trace._by_label(label)
    if found is None or not hasattr(found, "activation"):
        raise ReplacementMismatch(f"{who}: the source trace has no op at {label!r}; it must come from the same "
                                  "model run on inputs taking the same path")
    value = found.activation
    if value is None:
        raise ReplacementMismatch(f"{who}: the source trace did not save {found.label} (the value at {label!r}); "
                                  "trace it with save='all' or a save= list naming the site")
    return value


def _like(source: torch.Tensor, tensor: torch.Tensor, op, who: str) -> torch.Tensor:
    _castable(source, tensor, op, who)
    if source.layout != torch.strided or tensor.layout != torch.strided or source.is_nested or tensor.is_nested:
        return _like_unstrided(source, tensor, op, who)
    try:
        value = torch.broadcast_to(source, tensor.shape)
    except RuntimeError as exc:
        raise ReplacementMismatch(f"{who} at {_where(op)}: a value of shape {tuple(source.shape)} cannot replace "
                                  f"one of shape {tuple(tensor.shape)}") from exc
    # A copy (downstream in-place ops must not write into the other trace's activation or the user's tensor),
    # laid out as the value it replaces (channels_last stays so), which a broadcast mean or a source traced in
    # another memory format is not.
    return torch.empty_like(tensor).copy_(value.to(device=tensor.device, dtype=tensor.dtype))


def _like_unstrided(source: torch.Tensor, tensor: torch.Tensor, op, who: str) -> torch.Tensor:
    """A copy of ``source`` for a sparse or nested value, or one replaced by a sparse or nested tensor: no
    broadcast (torch has none for these layouts), so the shapes must be the same; a strided source is
    converted to a sparse value's layout, which keeps every value."""
    if not same_shape(source, tensor):
        raise ReplacementMismatch(f"{who} at {_where(op)}: a {layout_name(source)} value of shape "
                                  f"{tuple(shape_of(source))} cannot replace a {layout_name(tensor)} one of shape "
                                  f"{tuple(shape_of(tensor))} (no broadcast for these layouts: give the same shape)")
    value = source.to(device=tensor.device, dtype=tensor.dtype)
    if tensor.is_nested and value.is_nested and tensor.layout == torch.jagged == value.layout:
        # The same components under this value's own ragged size, which the ops after it compare by identity.
        value = torch.nested.nested_tensor_from_jagged(value.values(), tensor.offsets(), lengths=tensor.lengths())
    elif not tensor.is_nested and value.layout != tensor.layout and not value.is_nested:
        try:
            value = value.to_dense() if tensor.layout == torch.strided else value.to_sparse(layout=tensor.layout)
        except (RuntimeError, TypeError) as exc:
            raise ReplacementMismatch(f"{who} at {_where(op)}: a {layout_name(source)} value cannot be made a "
                                      f"{layout_name(tensor)} one ({exc}); give a tensor of that layout") from exc
    if value.layout != tensor.layout or value.is_nested != tensor.is_nested:
        raise ReplacementMismatch(f"{who} at {_where(op)}: a {layout_name(source)} value cannot replace a "
                                  f"{layout_name(tensor)} one; give a tensor of that layout")
    return value.clone()


def _of_its_kind(tensor: torch.Tensor, exc: Exception) -> str:
    """What a helper's refusal adds when torch's error names the value's tensor subclass: torch computes some (a
    ``DTensor``) only with tensors of their own type, so a plain tensor argument that broadcasts is refused too."""
    kind = type(tensor).__name__
    if type(tensor) in TENSOR_TYPES or kind not in str(exc):
        return ""
    return f", and be a {kind}, as the value is"


def layout_name(t: torch.Tensor) -> str:
    """``strided``, ``sparse_coo``, ..., ``nested`` (``nested jagged``) for a nested tensor, or ``quantized``."""
    if t.is_quantized:
        return f"quantized ({str(t.dtype).replace('torch.', '')})"
    name = str(t.layout).replace("torch.", "")
    return ("nested" if name == "strided" else f"nested {name}") if t.is_nested else name


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two values have one shape; nested ones component by component (a strided nested tensor has
    no ``.shape``, and two jagged ones made apart have different symbolic ragged sizes)."""
    if a.is_nested or b.is_nested:
        return a.is_nested and b.is_nested and [c.shape for c in a.unbind()] == [c.shape for c in b.unbind()]
    return a.shape == b.shape


def _checked_same_shape(source: torch.Tensor, tensor: torch.Tensor, op) -> torch.Tensor:
    """``source`` when it has the shape of the value it replaces.  The value at the same site of another run
    stands for this one only when the two runs made it alike; broadcast, a batch of one clean prompt (or a
    clean sequence of length one) would be written into every row of the corrupted run unnoticed."""
    if not same_shape(source, tensor):
        raise ReplacementMismatch(f"tl.patch_from at {_where(op)}: the source trace's value has shape "
                                  f"{tuple(shape_of(source))} but this run's has {tuple(shape_of(tensor))}; patch "
                                  "between runs of the same shape (batch size, sequence length), or pass the tensor "
                                  "itself as the action to broadcast it")
    return source


def _checked_kept_dims(action, source: torch.Tensor, tensor: torch.Tensor, op) -> torch.Tensor:
    """``source`` when its mean over ``action.dims`` stands for this value: the same rank, and the same size in
    every dimension the mean keeps.  Broadcast, the mean of prompts of length one would be written at every
    position of a longer run (or a 2-d source's at every position of a 3-d value) unnoticed."""
    if source.is_nested or tensor.is_nested or action.dims is None:  # nested: no broadcast; None: one number
        return source
    averaged = {d % tensor.dim() for d in _as_tuple(action.dims)}
    kept = [d for d in range(tensor.dim()) if d not in averaged]
    dims = ", ".join(map(str, sorted(averaged)))
    if source.dim() != tensor.dim() or any(source.shape[d] != tensor.shape[d] for d in kept):
        raise ReplacementMismatch(f"{action!r} at {_where(op)}: the source trace's value has shape "
                                  f"{tuple(shape_of(source))} but this run's has {tuple(shape_of(tensor))}, which "
                                  f"differ outside the dimensions averaged over ({dims}); take the"
                                  " mean from runs whose other dimensions (sequence length) match, or pass "
                                  "the mean itself as the action to broadcast it")
    return source


def _checked_holds_values(action, source: torch.Tensor, op) -> torch.Tensor:
    """``source`` when the dimensions its mean is taken over hold values.  The mean of none is NaN: from a run
    given an empty batch, it would be written into every element of this value, and the forward would carry it on
    as if it were a mean."""
    if source.is_nested:  # no .shape to read: its mean, if torch takes one, is over its components' values
        return source
    dims = _as_tuple(action.dims) or range(source.dim())
    if math.prod(source.shape[d] for d in dims):
        return source
    averaged = ", ".join(str(d) for d in _as_tuple(action.dims)) or "every dimension"
    raise ReplacementMismatch(f"{action!r} at {_where(op)}: the source trace's value has shape "
                              f"{tuple(source.shape)}, which holds no values to average over ({averaged}): their "
                              "mean is NaN; take the mean from a run with values there (a batch of at least one "
                              "example)")


def _castable(source: torch.Tensor, tensor: torch.Tensor, op, who: str) -> None:
    """``source`` may be cast to ``tensor``'s dtype: within its kind (float32 into bfloat16, an integer into
    a float), never across to a lower one, where the cast would quietly change the values (1.7 into an integer
    value reads 1, a complex one loses its imaginary part, 2 into a mask reads True)."""
    if not torch.can_cast(source.dtype, tensor.dtype):
        raise ReplacementMismatch(f"{who} at {_where(op)}: its {source.dtype} values cannot stand for this "
                                  f"{tensor.dtype} value without changing (a cast would truncate or drop "
                                  f"them); give a {tensor.dtype} tensor")


def _operand(action, name: str, number, tensor: torch.Tensor, op):
    """A helper's number as the value can take it.  A tensor is cast to the value's dtype and device within its kind
    (a float32 per-channel scale at a bfloat16 value, a float64 one from NumPy at a float32 value), which torch's
    promotion would otherwise widen the result to, as a hook writing ``out * k.to(out)`` would; across kinds it is
    refused (``_castable``).  At an integer or bool value (indices, counts, a mask) torch computes ``ids * 2.0`` or
    ``ids + 1.0 * vector`` in floats, though every number in them is whole: a whole number is used as the int it is
    (at a mask, 0 or 1); any other would be rounded into the value, and is refused naming the helper, the site and
    the dtype.  A quantized value stands for real numbers: it takes any number (torch clamps it to 0.1, and refuses
    what it has no kernel for, which ``Action.__call__`` names)."""
    if isinstance(number, torch.Tensor):
        if tensor.is_quantized:  # no cast to a quantized dtype: torch's own refusal is named with the site
            return number
        _castable(number, tensor, op, f"{action!r}'s {name}")
        return number.to(device=tensor.device, dtype=tensor.dtype)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.is_quantized:
        return number
    whole = isinstance(number, numbers.Real) and float(number).is_integer()
    if whole and (tensor.dtype != torch.bool or number in (0, 1)):
        return int(number)
    allowed = "0 or 1" if tensor.dtype == torch.bool else "a whole number"
    raise ReplacementMismatch(f"{action!r} at {_where(op)}: {name}={number!r} cannot apply to this {tensor.dtype} "
                              f"value (indices, counts or a mask) without rounding; give {allowed}, or keep a "
                              "predicate site to float values (lambda op: op.dtype.is_floating_point and ...)")


def _in_dtype(new: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``new`` in a mask's dtype: torch computes a bool value times 0 or 1, or clamped to them, in int64, whose
    values (0 and 1, the numbers having passed ``_operand``) a bool holds exactly."""
    return new.bool() if tensor.dtype == torch.bool and new.dtype != torch.bool else new


def _needs_float(action, tensor: torch.Tensor, op) -> None:
    """Noise and a mean are no values of an integer or bool dtype (indices, counts, masks): the helper
    refuses such a value rather than rounding what it computed into it."""
    if not (tensor.is_floating_point() or tensor.is_complex() or tensor.is_quantized):
        raise ReplacementMismatch(f"{action!r} at {_where(op)}: the value is {tensor.dtype} (indices, counts or a "
                                  f"mask), which {type(action).__name__} cannot change without rounding; "
                                  "tl.zero_ablate, tl.clamp, tl.patch_from or a tensor of that dtype can, and a "
                                  "predicate site can keep to float values (lambda op: op.dtype.is_floating_point "
                                  "and ...)")


def _as_tuple(dims) -> tuple:
    """``mean``'s ``dim`` as a tuple: None (every dimension) names none to check."""
    return () if dims is None else tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)


def _check_dims(action, dims, tensor: torch.Tensor, op) -> None:
    """Each of ``dims`` must be a dimension of the value: taken modulo its rank, dim=5 of a 3-d value would
    quietly be dimension 2."""
    rank = tensor.dim()
    wrong = [d for d in dims if not -rank <= d < rank]
    if wrong:
        # A 0-d value (a loss, a scalar gate) has no range of dimensions to name: "0 to -1" would read as one.
        valid = f"dimensions {-rank} to {rank - 1}" if rank else "a 0-d value, which has no dimensions"
        raise ReplacementMismatch(f"{action!r} at {_where(op)}: {wrong[0]} is not a dimension of this value of "
                                  f"shape {tuple(tensor.shape)} ({valid})")
    if len({d % rank for d in dims}) != len(dims):  # dims=(1, -1) of a 2-d value: one dimension twice
        raise ReplacementMismatch(f"{action!r} at {_where(op)}: dims={tuple(dims)} name one dimension of this value "
                                  f"of shape {tuple(tensor.shape)} twice; name each once")


def _where(op) -> str:
    return getattr(op, "label", None) or "the site"
