"""``log.summary()``: the module tree as a table, one row per module call, with counts that add up.

Each row is one call (``encoder.layers.0:1``) with its class, the parameters reachable from its module
(each parameter object counted once, so a tied embedding and head count their shared weight once), the
shapes going in and out, the ops run inside it, their analytic FLOPs (``report/flops.py``: a multiply-add
is 2 FLOPs, shown as FLOPs, never as bytes), the instrumented host time, and the bytes of the tensors its
ops produced.  When the trace recorded what autograd saves (``saved_for_backward=True``) a column for it
appears; otherwise it is left out rather than shown as zeros.
"""

from __future__ import annotations

from ..checks import as_position, check_int
from ..errors import closest_hint, counted, first_few, listed
from ..tree import is_uninitialized
from .columns import Kind
from .layouts import numel_of, shape_text
from .model_index import holds_packed_weights
from .modules import call_op_counts, inclusive_totals
from .params import listed_params
from .grads import saved_for_backward_bytes
from .summary import COUNT_UNITS, aligned_lines, human_bytes, unit_for

COLUMNS = ("call", "depth", "class_name", "params", "input_shapes", "output_shapes", "ops", "flops",
           "flops_complete", "duration", "activation_bytes")
SAVED_FOR_BACKWARD = "saved_for_backward_bytes"


def module_param_counts(trace) -> dict:
    """``{module address: unique parameter count under it}``, over the parameters each module had when its
    model was traced (``params_by_module``), kept after cleanup and saved with the trace; a loaded trace from
    a file without those counts (an older torchlens) counts the parameters its ops used instead
    (``counts_from_used_params`` then says so)."""
    counts = trace._module_param_counts
    if counts is None:
        rows = trace._module_rows
        live = [row for row in rows if row.ref is not None]
        if live or not rows:
            at_forward, memo = trace._params_by_module or {}, {}
            numel = _numel_at_forward(trace._replay)
            counts = {row.address: _count_under(row.ref, at_forward, memo, numel) for row in live}
            trace._params_by_module = None  # the counts are kept: the modules need not be
        else:
            counts = _used_param_counts(trace)
            trace._param_counts_from_ops = True
        trace._module_param_counts = counts
    return counts


def params_by_module(index) -> dict:
    """``{id(module): (module, its parameters)}`` for every module of the model as the index walked it: each
    parameter object once per module, so tied weights count once, as ``module.parameters()`` counts them.
    Made once per model structure (the index is shared by the traces of an unchanged model), so a module
    given parameters after a trace (an adapter, a new head) does not count them in that trace's table."""
    memo: dict = {}  # shared by nested modules: the model is walked once
    root = index.root
    # The root is held as None: a cached index must not keep its model alive (its submodules it holds already).
    return {id(m): (None if m is root else m, list(_params_under(m, memo).values())) for m in index.all_modules()}


def _numel_at_forward(replay):
    """``numel(parameter)`` as the forward read it (its shape kept when the trace ended: a resize in place since
    does not count), else as it is now."""
    layouts = replay.param_layouts if replay is not None else None

    def numel(p) -> int:
        layout = layouts.get(id(p)) if layouts is not None else None
        return numel_of(layout[0]) if layout is not None else _numel_now(p)

    return numel


def _count_under(module, at_forward: dict, memo: dict, numel) -> int:
    known = at_forward.get(id(module))
    if known is not None and (known[0] is module or known[0] is None):  # None: the root, alive with the trace
        return sum(map(numel, known[1]))
    return sum(map(_numel_now, _params_under(module, memo).values()))  # a module made in the forward


def _numel_now(p) -> int:
    """``p.numel()``, or 0 for a lazy module's parameter not yet initialized: it has no elements to count (torch
    refuses to read its size), and the summary names it as not counted."""
    return 0 if is_uninitialized(p) else p.numel()


def _params_under(module, memo: dict) -> dict:
    """``{id(parameter): parameter}`` for the parameters reachable from ``module``, each object once."""
    found = memo.get(id(module))
    if found is None:
        own, children = module._parameters, module._modules
        if type(own) is not dict or type(children) is not dict:  # a TorchScript module's wrappers: torch walks it
            found = memo[id(module)] = {id(p): p for p in module.parameters()}
            return found
        found = memo[id(module)] = {id(p): p for p in own.values() if p is not None}
        for child in children.values():
            if child is not None:
                found.update(_params_under(child, memo))
    return found


def counts_from_used_params(trace) -> bool:
    """Whether the summary's parameter counts were rebuilt from the parameters the ops used (a trace saved
    by an older torchlens, which kept neither the per-module counts nor the full parameter table)."""
    module_param_counts(trace)
    return trace._param_counts_from_ops or not trace._params_listed


def _used_numels(trace) -> dict:
    """``{parameter address: numel}`` for every parameter an op used (from the recorded shapes)."""
    # A loaded trace's saved table (io/params.py); an uninitialized parameter has no count
    numels = {p.address: p.numel for p in listed_params(trace) if p.numel is not None}
    for i, addresses in trace._param_addresses.items():
        for address, (_, param) in zip(addresses, trace.calls[trace._call[i]].params):
            n = 1
            for d in param.shape:
                n *= d
            numels[address] = n
    return numels


def _used_param_counts(trace) -> dict:
    numels = _used_numels(trace)
    used: dict = {}
    for mc in trace.module_calls:
        addresses = used.setdefault(mc.address, set())
        for i in mc._op_nodes:
            addresses.update(trace._param_addresses.get(i, ()))
    # A trace saved after cleanup() kept no parameter shapes: its counts are unknown, not zero.
    return {address: sum(numels[a] for a in names) for address, names in used.items()
            if all(a in numels for a in names)}


def uninitialized_params(trace) -> list:
    """Addresses of the parameters a lazy module's forward never initialized (``nn.LazyLinear`` never called):
    they have no shape, so the parameter counts leave them out."""
    return [p.address for p in listed_params(trace) if p.shape is None]


def root_param_count(trace):
    """Unique parameters of the whole model: 0 for a model without any (for a loaded trace from a file
    without the parameter table: those its ops used, None when even their shapes were not kept).  None for a
    callable traced without ``root=``: there is no model, and its empty parameter table counted 0 above rows
    of modules holding parameters."""
    if trace._rootless:
        return None
    if trace._params_listed:  # a live trace, or a file with the parameter table (io/params.py)
        return sum(p.numel for p in trace.params if p.numel is not None)  # uninitialized_params: not counted
    numels = _used_numels(trace)
    used = {a for addresses in trace._param_addresses.values() for a in addresses}
    return sum(numels.values()) if used <= set(numels) else None


class ModuleSummary:
    """The rows of ``log.summary()``; ``print`` it for the tree, ``.to_pandas()`` for a DataFrame.

    Plain data, like the other reports: it holds no trace, so a summary kept (a list of them over many
    inputs) keeps no activations or model alive, and it pickles and copies as a table does."""

    def __init__(self, rows: list, columns: tuple, param_notes: tuple = ()):
        self.rows = rows
        self.columns = columns
        self.param_notes = param_notes  # what the printed parameter count leaves out, and why (_param_notes)

    def to_pandas(self):
        from .tables import require_pandas

        return require_pandas().DataFrame(self.rows, columns=list(self.columns))

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __contains__(self, key) -> bool:
        """A call label is in the table when ``table[label]`` finds its row (``"fc1:1" in table``), and a row when it
        is one of the rows: Python's fallback compared a label with each row and always answered False."""
        if isinstance(key, str):
            return self._row_of_call(key) is not None
        return key in self.rows

    def _row_of_call(self, call: str):
        """The row of module call ``call`` (``"fc1:1"``), or None."""
        return next((row for row in self.rows if row["call"] == call), None)

    def __getitem__(self, key):
        key = as_position(key)  # a NumPy integer is a row number
        if isinstance(key, bool):  # an int to Python, but never meant as row 0 or row 1
            raise TypeError(f"index a summary with a row number or a module call ('fc1:1'), not a bool ({key!r})")
        if isinstance(key, int):
            if not -len(self.rows) <= key < len(self.rows):
                raise IndexError(f"summary row {key} is out of range: this summary has {len(self.rows)} rows")
            return self.rows[key]
        if not isinstance(key, str):
            raise TypeError(f"index a summary with a row number or a module call ('fc1:1'), not "
                            f"{type(key).__name__}")
        row = self._row_of_call(key)
        if row is not None:
            return row
        calls = [r["call"] for r in self.rows]
        hint = closest_hint(key, calls) or f"; rows: {listed(calls, 8)}"
        raise KeyError(f"no row {key!r} in this summary (a row is a module call, 'fc1:1'){hint}")

    def __str__(self) -> str:
        return summary_table_text(self)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        try:
            return self.to_pandas().to_html(index=False)
        except ImportError:  # no pandas: the text table still shows
            import html

            return f"<pre>{html.escape(str(self))}</pre>"


def module_summary(trace, depth=None) -> ModuleSummary:
    if depth is not None:
        check_int(depth, "depth", "give a module depth, 0 or more (0: the whole model only), or None for every "
                  "module", who="summary", at_least=0)
    from ..report.flops import FlopCount, module_call_flops, total_flops

    ops = trace.ops
    produced = [produced_bytes(trace, i) for i in range(len(ops))]
    packlog = trace._packlog  # tl.trace(..., saved_for_backward=True): what autograd kept, per op
    has_backward = packlog is not None and packlog.note_text is None
    try:
        call_flops, whole_flops = module_call_flops(trace), total_flops(trace)
    except RuntimeError:  # cleaned up before FLOPs were derived: leave the column empty
        call_flops, whole_flops = {}, None
    param_counts = module_param_counts(trace)
    compute = [i for i in range(len(ops)) if trace._kind[i] == Kind.OP]
    call_counts, call_bytes = call_op_counts(trace), inclusive_totals(trace, produced)

    def row(call, depth_, class_name, params, inputs, outputs, counted, flops, duration, members):
        entry = {
            "call": call, "depth": depth_, "class_name": class_name, "params": params,
            "input_shapes": [tuple(trace._meta[i].shape) for i in inputs],
            "output_shapes": [tuple(trace._meta[i].shape) for i in outputs],
            "ops": counted[0], "flops": int(flops) if flops is not None else None,
            "flops_complete": flops.complete if isinstance(flops, FlopCount) else None,
            "duration": duration, "activation_bytes": counted[1],
        }
        if has_backward:
            # Distinct storages over the call's ops: a tensor two ops saved counts once.
            entry[SAVED_FOR_BACKWARD] = saved_for_backward_bytes(trace, members())
        return entry

    forward = trace.timings.get("forward")
    rows = [row(trace.model_name, -1, _root_class(trace), root_param_count(trace),
                [op.index for op in trace.inputs], [trace.output_producer(op.index) for op in trace.outputs
                                                    if trace.output_producer(op.index) >= 0],
                (len(compute), sum(produced[i] for i in compute)), whole_flops, forward, lambda: compute)]
    for mc in trace.module_calls:
        if depth is not None and mc.depth >= depth:
            continue
        k = mc.index
        rows.append(row(mc.label, mc.depth, mc.module.class_name, param_counts.get(mc.address),
                        [i for i in mc._input_nodes if i >= 0], [i for i in mc._output_nodes if i >= 0],
                        (call_counts[k], call_bytes[k]), call_flops.get(mc.label), mc.duration,
                        lambda mc=mc: mc._op_nodes))
    columns = COLUMNS + ((SAVED_FOR_BACKWARD,) if has_backward else ())
    return ModuleSummary(rows, columns, _param_notes(trace, rows[0]["params"]))


def _param_notes(trace, root_params) -> tuple:
    """The notes the printed Parameters line adds to the whole model's count ``root_params``: why there is
    none, where it comes from, and what it leaves out."""
    notes = []
    if trace._rootless:
        notes.append(f"{trace.model_name} was traced without root=, so there is no model whose parameters to count "
                     "(each module's row counts its own; tl.trace(f, x, root=model) counts the model's)")
    if root_params is not None and trace.loaded_from is not None and counts_from_used_params(trace):
        notes.append("this trace was saved without its parameter counts, so they count the parameters its ops used")
    uninitialized = uninitialized_params(trace)
    if uninitialized:
        notes.append(f"not counted: {counted(len(uninitialized), 'uninitialized parameter')} of lazy modules the "
                     f"forward never called, with no shape yet ({first_few(uninitialized)})")
    if holds_packed_weights(trace):
        notes.append("the packed weights of quantized modules are not parameters and are not counted (log.caveats)")
    return tuple(notes)


def _root_class(trace) -> str:
    known = trace._root_class  # set by tl.trace: the root module's class
    if known is not None:
        return known
    return type(trace._model).__name__ if trace._model is not None else trace.model_name


def produced_bytes(trace, i: int) -> int:
    """Bytes of the tensor a compute op produced: its output's size (a view's in full), and 0 for an in-place op,
    which wrote into a tensor another op produced.  The summary's Act. mem, ``hot_path(by="memory")`` and
    ``color_by="memory"`` all count it, so that a module's total counts each tensor once."""
    if trace._kind[i] != Kind.OP or trace._inplace[i]:
        return 0
    return numel_of(trace._meta[i].shape) * getattr(trace._meta[i].dtype, "itemsize", 0)


# ----- text ---------------------------------------------------------------------------------------------
def _count_shown(value: float, suffix: str) -> float:
    return int(value) if suffix == "" else round(value, 2)


def human_count(n) -> str:
    """A count in the table's form: whole below a thousand, else two decimals and a unit up to G."""
    if n is None:
        return "-"
    unit, scale = unit_for(n, COUNT_UNITS[:4], _count_shown)
    return str(int(n)) if unit == "" else f"{n / scale:.2f} {unit}"


def flops_text(row) -> str:
    """A row's FLOPs, with ``+`` where ops inside it have no formula: the count is then a lower bound."""
    return human_count(row["flops"]) + ("" if row["flops_complete"] in (True, None) else "+")


INCOMPLETE_FLOPS_NOTE = "a '+' marks rows with ops no formula covers, or TorchScript modules whose ops go uncounted"


def _shapes(shapes) -> str:
    text = ", ".join(shape_text(s) for s in shapes) or "-"
    return text if len(text) <= 22 else text[:21] + "~"


def summary_table_text(summary: ModuleSummary) -> str:
    backward = SAVED_FOR_BACKWARD in summary.columns
    header = ["Module call", "Class", "Params", "Input", "Output", "Ops", "FLOPs", "Time", "Act. mem"]
    if backward:
        header.append("Saved for bwd")
    table = [header]
    for r in summary.rows:
        name = "  " * (r["depth"] + 1) + r["call"] if r["depth"] >= 0 else r["call"]
        flops = flops_text(r)
        time = f"{r['duration'] * 1e3:.2f} ms" if r["duration"] is not None else "-"
        cells = [name, r["class_name"], human_count(r["params"]), _shapes(r["input_shapes"]),
                 _shapes(r["output_shapes"]), str(r["ops"]), flops, time, human_bytes(r["activation_bytes"])]
        if backward:
            cells.append(human_bytes(r[SAVED_FOR_BACKWARD]))
        table.append(cells)
    # Each column as wide as its longest cell: a capped width let a deep call's label (T5's
    # encoder.block.0.layer.0.SelfAttention.q:1, indented) push its row's numbers out of line with the rest.
    lines = aligned_lines(table, right={2, 5, 6, 7, 8, 9})
    lines.insert(1, "-" * len(lines[0]))
    root = summary.rows[0]
    lines.append("-" * len(lines[0]))
    params = "unknown" if root["params"] is None else f"{root['params']:,} (each parameter counted once, tied " \
                                                      "weights included)"
    lines.append("; ".join(("Parameters: " + params, *summary.param_notes)))
    if root["flops"] is not None:
        incomplete = "" if root["flops_complete"] else f" ({INCOMPLETE_FLOPS_NOTE})"
        lines.append(f"Forward FLOPs: {root['flops']:,} (a multiply-add counts 2){incomplete}")
    lines.append("Times are instrumented host times (for ranking); Act. mem is the bytes of the tensors each "
                 "call's ops produced (an in-place op adds 0)")
    return "\n".join(lines)
