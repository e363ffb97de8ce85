"""``tl.load(path)``: rebuild a ``Trace`` from a folder written by ``log.save``, trusting nothing in it.

The manifest is checked first (format, schema version, every file's size and sha256), then every
column of ``trace.json`` is checked for type, length and index range before a ``Trace`` is built, so a
damaged or hand-edited file is refused with a ``TraceFileError`` naming the problem instead of failing
later inside some view.  Nothing in the folder is executed: JSON and safetensors are data formats, torch
callables are not resolved from their stored names (a loaded op's ``func`` is None), and source
locations are file names and line numbers only.
"""

from __future__ import annotations

import os
import types

import torch

from ..checks import check_path
from ..errors import refusing_unknown_keywords
from ..record.columns import Call, Kind, OpMeta
from ..record.layouts import RaggedShape, version_of
from ..record.modules import CallRow, ModuleRow
from ..record.trace import Trace
from .encode import decode_value, torch_constant
from .format import (MANIFEST, TRACE_FORMAT, TRACE_JSON, TRACE_SCHEMA, TRACE_TENSORS, TraceFileError, check_index,
                     check_string, is_int, read_json, verify_manifest)
from .grads import read_grads
from .interventions import read_interventions
from .params import read_module_param_counts, read_params
from .recover import recover_killed_save
from .tensorfile import laid_out, read_tensor_file
from .trace_state import read_trace_state



_READS = 3  # reads of a folder a save keeps replacing before its last error is raised


@refusing_unknown_keywords("tl.load")
def load(path) -> Trace:
    """Load a saved trace.  It supports everything that does not need the live model (indexing, summary,
    tables, reports, rendering); ``log.model`` is None, ``log.validate()`` raises, and ``log.output`` is
    rebuilt from the saved output tensors."""
    folder = check_path(path, "path", "give the folder log.save wrote (a str or a pathlib.Path)", who="tl.load")
    for read in range(_READS):
        recover_killed_save(folder)  # also waits for a save moving its trace in now (io/recover.py)
        version = _version_of(folder)
        try:
            return _read(folder)
        except (TraceFileError, FileNotFoundError) as exc:
            if read + 1 < _READS and (version is None or _version_of(folder) != version):
                continue  # a save over the folder moved its files while they were read: read the new ones
            if isinstance(exc, FileNotFoundError):
                raise TraceFileError(f"{folder}: {exc.filename} went missing while it was read; load again") from None
            raise


def _version_of(folder: str):
    """Which saved trace ``folder`` holds, as the file system tells them apart: a save over it moves a new folder,
    or a new manifest, into place."""
    try:
        return os.stat(folder).st_ino, os.stat(os.path.join(folder, MANIFEST)).st_ino
    except OSError:
        return None


def _read(folder: str) -> Trace:
    manifest = verify_manifest(folder, TRACE_FORMAT, TRACE_SCHEMA, required=(TRACE_JSON,))
    record = read_json(folder, TRACE_JSON, "a saved trace", max_bytes=manifest["files"][TRACE_JSON]["bytes"])
    tensors = read_tensor_file(folder, TRACE_TENSORS) if TRACE_TENSORS in manifest["files"] else {}
    try:
        trace = _build(record, tensors)
    except TraceFileError as exc:  # column checks name the file; add the folder
        raise TraceFileError(f"{folder}/{exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError, RuntimeError) as exc:
        raise TraceFileError(f"{folder}/{TRACE_JSON}: does not match trace schema {TRACE_SCHEMA} "
                             f"({type(exc).__name__}: {exc}); the file was edited or written by other software") \
            from None
    read_grads(trace, record, folder, manifest["files"])  # io/grads.py
    read_interventions(trace, record, folder, manifest["files"])  # io/interventions.py
    trace.loaded_from = folder
    return trace


class _Columns:
    """Checks on the decoded JSON: each failure names the column and what was wrong."""

    def __init__(self, record: dict):
        if not isinstance(record, dict):
            raise TraceFileError(f"{TRACE_JSON} holds a {type(record).__name__}, not a trace record")
        self.record = record
        self.n = self.count("n_ops")

    def get(self, name):
        if name not in self.record:
            raise TraceFileError(f"{TRACE_JSON}: column {name!r} is missing")
        return self.record[name]

    def count(self, name) -> int:
        value = self.get(name)
        if not is_int(value) or value < 0:
            raise TraceFileError(f"{TRACE_JSON}: {name!r} must be a non-negative integer")
        return value

    def column(self, name, n=None) -> list:
        value = self.get(name)
        if not isinstance(value, list) or (n is not None and len(value) != n):
            raise TraceFileError(f"{TRACE_JSON}: column {name!r} must be a list of {n if n is not None else 'rows'}"
                                 f" entries")
        return value

    def ints(self, name, lo, hi) -> list:
        values = self.column(name, self.n)
        for v in values:
            check_index(v, lo, hi, name)
        return values

    def strings(self, name) -> list:
        values = self.column(name, self.n)
        if not all(isinstance(v, str) for v in values):
            raise TraceFileError(f"{TRACE_JSON}: column {name!r} must hold strings")
        return values


def _build(record, tensors: dict) -> Trace:
    cols = _Columns(record)
    n = cols.n
    calls = _calls(cols, n)
    module_calls, modules, call_ops = _modules(cols, n)
    kind = cols.ints("kind", 0, 4)
    call = cols.ints("call", -1, len(calls))
    _check_calls_match_ops(kind, call, calls)
    group = cols.ints("group", 0, 1 << 62)
    group_size = {check_index(g, 0, 1 << 62, "group_size"): check_index(k, 1, n + 1, "group_size")
                  for g, k in cols.column("group_size")}
    if any(g not in group_size for g in group):
        raise TraceFileError(f"{TRACE_JSON}: 'group' names a group missing from 'group_size'")
    meta = [_meta(m) for m in cols.column("meta", n)]
    parents = [_edges(ps, n, "parents") for ps in cols.column("parents", n)]
    _check_outputs_have_one_parent(kind, parents)
    activations = _activations(cols, laid_out(tensors, record.get("activation_strides"), "'activation_strides'"), meta)
    finite = {check_index(i, 0, n, "finite"): (bool(a), bool(b)) for i, a, b in cols.column("finite")}
    trace = Trace(
        model_name=check_string(cols.get("model_name"), "model_name"),
        calls=calls,
        kind=kind,
        call=call,
        slot=[decode_value(s) for s in cols.column("slot", n)],
        meta=meta,
        parents=parents,
        module_call=cols.ints("module_call", -1, len(module_calls)),
        inplace=[bool(x) for x in cols.column("inplace", n)],
        io={check_index(i, 0, n, "io"): check_string(p, "io") for i, p in cols.column("io")},
        labels=cols.strings("labels"),
        layer_labels=cols.strings("layer_labels"),
        pass_col=cols.ints("pass", 1, n + 1),
        group=group,
        group_size=group_size,
        types=cols.strings("types"),
        func_names=cols.strings("func_names"),
        activations=activations,
        dropped={check_index(i, 0, n, "dropped"): check_string(r, "dropped") for i, r in cols.column("dropped")},
        finite=finite,
        param_addresses={check_index(i, 0, n, "param_addresses"): tuple(check_string(a, "param_addresses") for a in ps)
                         for i, ps in cols.column("param_addresses")},
        call_rows=module_calls,
        module_rows=modules,
        call_op_indices=call_ops,
        output=None,
        model=None,
        unattributed=cols.count("unattributed"),
        timings={check_string(k, "timings"): float(v) for k, v in cols.get("timings").items()},
        budget_exhausted_at=_optional_index(cols.get("budget_exhausted_at"), n),
        # A read by the returned output is numbered after the last call (capture/state.py ``producer_of``).
        alias_reads=frozenset((check_index(c, 0, len(calls) + 1, "alias_reads"), check_index(p, -1, n, "alias_reads"))
                              for c, p in cols.column("alias_reads")),
    )
    # Held by reference like a live trace's: written in place since (through op.activation), one reads as dropped
    # with the reason, as there, instead of showing (and saving again) a value its op never made.  Loaded under
    # torch.inference_mode(), a tensor has no version counter (None), and a write cannot be seen, as live.
    versions = {i: version_of(t) for i, t in activations.items()}
    trace._saved_versions = {i: v for i, v in versions.items() if v is not None}
    flops = _flops(record.get("flops"), n)
    if flops is not None:
        trace._flops_col = flops
    trace.saved_func_paths = _func_paths(cols)
    for name in ("rank", "world_size"):  # absent from traces saved before distributed support
        value = record.get(name)
        if value is not None:
            setattr(trace, name, check_index(value, 0, 1 << 31, name))
    read_params(trace, record.get("params"))  # io/params.py
    read_module_param_counts(trace, record.get("module_param_counts"))
    read_trace_state(trace, record)  # io/trace_state.py
    if "output_structure" in record:
        trace._output_structure = (_output_structure(record["output_structure"], len(trace.outputs)),)
    if cols.get("cleaned_up") is True:
        trace.cleanup()
    return trace


def _check_outputs_have_one_parent(kind: list, parents: list) -> None:
    """An output op stands for the tensor its one parent made (``Trace.output_producer``): without exactly one,
    every view that shows outputs would fail."""
    for index, (k, ps) in enumerate(zip(kind, parents)):
        if k == Kind.OUTPUT and len(ps) != 1:
            raise TraceFileError(f"{TRACE_JSON}: parents: output op #{index} has {len(ps)} parents; an output has "
                                 "exactly one")


def _check_calls_match_ops(kind: list, call: list, calls: list) -> None:
    """Each op is an output of exactly one call, and each call's outputs are the ops it names (``first_record`` on,
    ``num_outputs`` of them), as capture records them; an input, buffer or output op has no call.  Views that
    read an op's call (``tl.debug.hot_path``, the profile tables) would otherwise fail on a file edited so."""
    for index, (k, c) in enumerate(zip(kind, call)):
        if (k == Kind.OP) != (c >= 0):
            raise TraceFileError(f"{TRACE_JSON}: call: op #{index} is {Kind(k).label}, which "
                                 f"{'a torch call makes' if k == Kind.OP else 'no torch call makes'}, but names "
                                 f"call {c}")
    for c, row in enumerate(calls):
        rows = range(row.first_record, row.first_record + row.num_outputs)
        if rows.stop > len(call) or any(call[i] != c for i in rows):
            raise TraceFileError(f"{TRACE_JSON}: calls: call #{c} names ops #{rows.start} to #{rows.stop - 1} as its "
                                 "outputs, which are not all ops it made")


def _output_structure(encoded, n_outputs: int):
    """The saved output structure, each ``OutputSlot`` checked to name one of the ``n_outputs`` outputs."""
    from ..record.saved_output import OutputSlot

    structure = decode_value(encoded)
    pending = [structure]
    while pending:
        value = pending.pop()
        if isinstance(value, OutputSlot):
            check_index(value.index, 0, n_outputs, "output_structure")
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return structure


def _optional_index(v, n):
    return None if v is None else check_index(v, 0, n, "budget_exhausted_at")


def _edges(pairs, n, what) -> tuple:
    """``((argument position, op index), ...)``; a position is an argument's index or keyword name, or, for a
    tensor inside a container argument, that followed by the path into it (``(1, 0)``, ``("tensors", 1)``)."""
    out = []
    for position, index in pairs:
        position = decode_value(position)
        if isinstance(position, list):
            position = tuple(position)
        parts = position if isinstance(position, tuple) and len(position) >= 2 else (position,)
        if not all(is_int(p) or isinstance(p, str) for p in parts):
            raise TraceFileError(f"{TRACE_JSON}: {what}: bad argument position {position!r}")
        out.append((position, check_index(index, -1, n, what)))
    return tuple(out)


_grad_fn_stubs: dict = {}


def _grad_fn_stub(name):
    # Op.grad_fn reads ``cls.__name__``; a named stand-in class keeps that working without the autograd node.
    if name is None:
        return None
    stub = _grad_fn_stubs.get(name)
    if stub is None:
        stub = _grad_fn_stubs[name] = types.SimpleNamespace(__name__=check_string(name, "grad_fn"))
    return stub


def _meta(m) -> OpMeta:
    shape, dtype, device, requires_grad, grad_fn, *ragged = m  # ragged: [numel] of a nested tensor
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 or d is None and ragged for d in shape):
        raise TraceFileError(f"{TRACE_JSON}: meta: bad shape {shape!r}")
    if ragged and not (len(ragged) == 1 and is_int(ragged[0]) and ragged[0] >= 0):
        raise TraceFileError(f"{TRACE_JSON}: meta: bad element count {ragged!r}")
    return OpMeta(RaggedShape(shape, ragged[0]) if ragged else torch.Size(shape), torch_constant("dtype", dtype),
                  torch.device(check_string(device, "meta device")), bool(requires_grad), _grad_fn_stub(grad_fn))


def _activations(cols, tensors: dict, meta: list) -> dict:
    out = {}
    for index, key in cols.column("activations"):
        check_index(index, 0, cols.n, "activations")
        if not isinstance(key, str) or key not in tensors:
            raise TraceFileError(f"{TRACE_JSON}: activation {key!r} is not in {TRACE_TENSORS}")
        t = tensors[key]
        shape, dtype = meta[index].shape, meta[index].dtype
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise TraceFileError(f"{TRACE_TENSORS}: tensor {key!r} is {tuple(t.shape)} {t.dtype}, but op #{index} "
                                 f"recorded {tuple(shape)} {dtype}")
        out[index] = t
    return out


class _SavedCode:
    """Stands in for a user frame's code object: its file, function and the one line a call ran.

    ``Op.source`` resolves ``(code, instruction offset)`` through ``co_lines()``; a saved trace stores the
    resolved line, so this code's single range maps offset 0 to that line.
    """

    __slots__ = ("co_filename", "co_qualname", "co_name", "co_firstlineno")

    def __init__(self, filename: str, qualname: str, line: int):
        self.co_filename = filename
        self.co_qualname = qualname
        self.co_name = qualname.rsplit(".", 1)[-1]
        self.co_firstlineno = line

    def co_lines(self):
        return iter(((0, 1, self.co_firstlineno),))


def _code_stub(codes, i, line, cache):
    if i < 0 or line is None:
        return None
    key = (i, line)
    stub = cache.get(key)
    if stub is None:
        filename, qualname = codes[i]
        stub = cache[key] = _SavedCode(check_string(filename, "codes"), check_string(qualname, "codes"), line)
    return stub


def _func_paths(cols) -> tuple:
    """Each call's function as saved, by qualified name (``_calls`` has checked the indices)."""
    funcs = cols.column("funcs")
    return tuple(check_string(funcs[row[0]], "funcs") for row in cols.column("calls"))


def _calls(cols, n) -> list:
    codes = cols.column("codes")
    n_funcs = len(cols.column("funcs"))
    n_module_calls = len(cols.column("module_calls"))
    calls, stubs = [], {}
    for row in cols.column("calls"):
        f, args, kwargs, parents, module_call, code, line, t0, t1, first, n_out, wrote, params = row
        check_index(f, 0, n_funcs, "calls.func")
        check_index(code, -1, len(codes), "calls.code")
        kwargs = decode_value(kwargs)
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TraceFileError(f"{TRACE_JSON}: calls: keyword arguments must be a dict")
        calls.append(Call(None, decode_value(args), kwargs, _edges(parents, n, "calls.parents"), _params(params),
                          check_index(module_call, -1, n_module_calls, "calls.module_call"),
                          _code_stub(codes, code, None if line is None else check_index(line, 0, 1 << 31, "calls.line"),
                                     stubs), 0,
                          _ns(t0), _ns(t1), check_index(first, 0, n, "calls.first_record"),
                          check_index(n_out, 1, n + 1, "calls.num_outputs"), bool(wrote), None))
    return calls


def _params(rows) -> tuple:
    # Parameters are stored by shape (what reports such as FLOPs read), never by value.
    out = []
    for (position, _), (_, shape) in zip(_edges([(p, 0) for p, _ in rows], 1, "calls.params"), rows):
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise TraceFileError(f"{TRACE_JSON}: calls.params: bad shape {shape!r}")
        out.append((position, types.SimpleNamespace(shape=torch.Size(shape))))
    return tuple(out)


def _flops(column, n):
    if column is None:
        return None
    if not isinstance(column, list) or len(column) != n or not all(
            c is None or (isinstance(c, dict) and all(isinstance(k, str) and is_int(v) for k, v in c.items()))
            for c in column):
        raise TraceFileError(f"{TRACE_JSON}: column 'flops' must hold, per op, null or {{family: integer}}")
    return column


def _ns(v) -> int:
    if not is_int(v):
        raise TraceFileError(f"{TRACE_JSON}: a timestamp must be an integer of nanoseconds, got {v!r}")
    return v


def _modules(cols, n):
    """The module rows, the module call rows and each call's op indices (``record.modules``)."""
    modules = []
    for address, addresses, class_name, param_names in cols.column("modules"):
        modules.append(ModuleRow(check_string(address, "modules"), [check_string(a, "modules") for a in addresses],
                                 check_string(class_name, "modules"),
                                 [check_string(p, "modules") for p in param_names]))
    module_calls, call_ops, numbered = [], [], set()
    for index, row in enumerate(cols.column("module_calls")):
        module, call_index, parent, start, end, inputs, outputs, op_nodes = row
        m = check_index(module, 0, len(modules), "module_calls.module")
        module_calls.append(CallRow(m, check_index(call_index, 1, n + 2 + index, "module_calls.call_index"),
                                    check_index(parent, -1, index, "module_calls.parent"), _ns(start),
                                    None if end is None else _ns(end),
                                    tuple(check_index(i, -1, n, "module_calls.inputs") for i in inputs),
                                    tuple(check_index(i, -1, n, "module_calls.outputs") for i in outputs)))
        call_ops.append([check_index(i, 0, n, "module_calls.ops") for i in op_nodes])
        if (m, call_index) in numbered:  # log["fc:2"] would name both
            raise TraceFileError(f"{TRACE_JSON}: module_calls: call #{index} is call {call_index} of module "
                                 f"{modules[m].address!r}, which an earlier call is")
        numbered.add((m, call_index))
        modules[m].calls.append(index)
    return module_calls, modules, call_ops
