"""What replay needs beyond an op's recorded call: the state the call ran under and the parameters' history.

Capture notes the grad mode and autocast state of a call only where they differ from the trace-wide state
(``grad_and_autocast``; for ``scaled_dot_product_attention`` also the attention backends it could choose
from, ``attention_backends``), and the value of a parameter before each write the forward made to it.
``record.finalize`` packs them, with the parameters' versions and requires_grad flags as the forward ended,
into the trace's ``ReplayContext``, which ``validate`` reads. ``global_settings`` are the process-wide
settings that change an op's bits, which capture reads as the forward begins and ends; ``as_traced`` puts
an op's recorded state and those settings in place while replay runs it, and back afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

_any_autocast = torch._C._is_any_autocast_enabled


def grad_and_autocast() -> tuple:
    """``(grad enabled, {device type: autocast dtype})``: the state replay must run an op under."""
    # One C call answers the common case (no autocast anywhere) without a query per device type.
    autocast = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)} \
        if _any_autocast() else {}
    return torch.is_grad_enabled(), autocast


def attention_backends() -> tuple:
    """The ``scaled_dot_product_attention`` backends enabled now, in the order torch tries them: what
    ``torch.nn.attention.sdpa_kernel`` sets, and which kernel (and so which low bits) a call gets."""
    from torch.nn.attention import _cur_sdpa_kernel_backends

    return tuple(_cur_sdpa_kernel_backends(with_priority=True))


class ByParam:
    """``id(Parameter) -> value`` for a model's parameters: read when the forward ends as one list in
    parameter order (a C-level pass), made a dict only when replay first asks (most traces never do)."""

    __slots__ = ("_ids", "_values", "_by_id")

    def __init__(self, ids: list, values: list):
        self._ids = ids  # the model index's, shared by its traces: never changed
        self._values = values
        self._by_id = None

    def get(self, key: int, default=None):
        by_id = self._by_id
        if by_id is None:  # two threads asking first build the same dict
            by_id = self._by_id = dict(zip(self._ids, self._values))
        return by_id.get(key, default)


# The call index of a parameter write no call showed (``Tensor.set_``): replay cannot place it before or after
# any op (record/finalize.py, note_unseen_param_writes).
UNSEEN_WRITE = -1


class ReplayContext(NamedTuple):
    """What replay needs to run each op as it ran (kept on the trace as ``_replay``)."""

    context: tuple  # grad_and_autocast() around the forward
    contexts: dict  # call index -> grad_and_autocast() where a call ran under another state (+ attention backends)
    param_writes: dict  # id(Parameter) -> [(call index or UNSEEN_WRITE, value before the write or None)]
    param_versions: ByParam  # id(Parameter) -> version when the forward ended
    param_requires_grad: ByParam  # id(Parameter) -> its requires_grad flag during the forward
    param_layouts: ByParam  # id(Parameter) -> its (shape, dtype) when the forward ended


def denormals_flushed() -> bool:
    """Whether ``torch.set_flush_denormal(True)`` is in effect on this thread, which torch has no getter for:
    a subnormal float32 times one reads zero when it is."""
    # On the CPU, whatever device a `with torch.device(...)` block around validation makes the default.
    return bool((torch.tensor([1e-40], device="cpu") * 1.0).eq(0).item())


_SETTINGS = {  # name -> (read it, set it)
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
    "mkldnn": (torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled),
}
_default_dtype, _num_threads, _mkldnn = (get for get, _ in _SETTINGS.values())


def global_settings() -> tuple:
    """The global settings that change an op's bits, which replay runs it under, in ``_SETTINGS``'s order: the
    default dtype (factories and Python scalars read it), the intra-op thread count (a parallel reduction
    splits its sum by it) and whether oneDNN (mkldnn) kernels may run (a convolution computes other low bits
    without them).  Read as every forward begins and ends, so three calls and a tuple; ``settings_by_name``
    names them for replay."""
    return _default_dtype(), _num_threads(), _mkldnn()


def settings_by_name(values: tuple) -> dict:
    """``global_settings()``'s values by name, as ``as_traced`` takes them."""
    return dict(zip(_SETTINGS, values))


def began_with(log) -> dict:
    """The global settings that change an op's bits as the forward began (``global_settings()``), which
    replay runs each op under whatever they are when you validate."""
    return settings_by_name(log._settings[0]) if log._settings else {}


def other_settings(log, op, began: dict):
    """The default dtype the forward ended with, and the op's output's own (``torch.set_default_dtype``
    called and undone inside the forward); subnormals flushed the other way (``torch.set_flush_denormal``,
    which torch gives no getter to record); the thread count the forward ended with, and one thread (what a
    forward pins with ``torch.set_num_threads`` for reproducible sums); oneDNN kernels the other way (a
    ``torch.backends.mkldnn.flags`` block inside the forward)."""
    ended = settings_by_name(log._settings[1]) if log._settings else {}
    saved = log.saved_activations.get(op.index)
    dtypes = [ended.get("default_dtype")]
    if isinstance(saved, torch.Tensor) and saved.dtype.is_floating_point:
        dtypes.append(saved.dtype)
    for dtype in dict.fromkeys(dtypes):
        if dtype is not None and dtype is not began.get("default_dtype"):
            yield {"default_dtype": dtype}
    yield {"flush_denormal": not denormals_flushed()}
    for threads in dict.fromkeys((ended.get("num_threads"), 1)):
        if threads is not None and threads != began.get("num_threads"):
            yield {"num_threads": threads}
    if "mkldnn" in began:
        yield {"mkldnn": not began["mkldnn"]}


@functools.lru_cache(maxsize=1)
def _factories() -> frozenset:
    """The calls a ``with torch.device(...)`` block gives its device to when they are given none."""
    from torch.utils._device import _device_constructors

    return frozenset(_device_constructors())


class ThreadSettings:
    """What ``as_traced`` may change on this thread, read before replay and put back after it, whatever was raised.
    ``as_traced`` undoes its changes through an ``ExitStack``, whose building and unwinding an interrupt can cut
    short: an op's autocast block left open ran every later forward of the thread at lower precision, and an op's
    grad mode, attention backends or global setting stayed in place."""

    def __init__(self):
        self.grad = torch.is_grad_enabled()
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.nesting = _autocast_nesting()
        self.settings = global_settings()
        self.flushed = denormals_flushed()
        self.attention = attention_backends(), torch._C._get_sdp_priority_order()

    def restore(self) -> None:
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        self._restore_autocast()
        for (get, put), value in zip(_SETTINGS.values(), self.settings):
            if get() != value:
                put(value)
        if denormals_flushed() != self.flushed:
            torch.set_flush_denormal(self.flushed)
        if (attention_backends(), torch._C._get_sdp_priority_order()) != self.attention:
            from torch.nn.attention import _sdpa_kernel

            _sdpa_kernel(self.attention[0])
            torch._C._set_sdp_priority_order(self.attention[1])

    def _restore_autocast(self) -> None:
        for device_type, enabled, dtype in self.autocast:
            if torch.is_autocast_enabled(device_type) != enabled or torch.get_autocast_dtype(device_type) != dtype:
                torch.set_autocast_enabled(device_type, enabled)
                torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        nesting = _autocast_nesting()
        while nesting > self.nesting:  # an autocast block left open: closed as its exit would
            nesting = torch.autocast_decrement_nesting()
            if nesting == 0:
                torch.clear_autocast_cache()


def _autocast_nesting() -> int:
    """How many autocast blocks are open on this thread (torch reads it only as it changes it)."""
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return nesting


def on_device(func, kwargs: dict, device) -> dict:
    """``kwargs`` for replaying ``func``: a factory (``torch.ones``, ``torch.arange``) given no device makes its
    output on ``device``, the one it made it on, whatever ``with torch.device(...)`` block is open around replay.
    Given by keyword, as such a block gives it, rather than by opening one: an interrupt landing as the block was
    entered or left kept its mode on the torch function-mode stack for good."""
    if device is not None and kwargs.get("device") is None and func in _factories():
        return {**kwargs, "device": device}
    return kwargs


def as_traced(log, context, setting: dict):
    """Grad mode and autocast exactly as the op ran under (``context``, with the attention backends a
    ``scaled_dot_product_attention`` call could choose from), and each global setting in ``setting`` that is
    not None (``global_settings()``'s, and ``flush_denormal``); a trace without a recorded context replays
    under no grad, with the autocast state around its forward."""
    stack = contextlib.ExitStack()
    for name, value in setting.items():
        if name == "flush_denormal":  # torch has no getter: the setting replay puts back is the other one
            if value is not None and torch.set_flush_denormal(value):  # False: this CPU cannot flush
                stack.callback(torch.set_flush_denormal, not value)
            continue
        get, put = _SETTINGS[name]
        if value is not None and value != get():
            stack.callback(put, get())
            put(value)
    if context is None:
        grad, autocast, attention = False, log._autocast, ()
    else:
        grad, autocast, *attention = context
    stack.enter_context(torch.set_grad_enabled(grad))
    if attention:  # scaled_dot_product_attention: the backends it chose its kernel from
        from torch.nn.attention import sdpa_kernel

        stack.enter_context(sdpa_kernel(list(attention[0]), set_priority=True))
    for device_type in ("cpu", "cuda"):
        if device_type in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=autocast[device_type]))
        elif torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack
