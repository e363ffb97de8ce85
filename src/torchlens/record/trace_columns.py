"""The column view of a trace: one list (or dict) per field, indexed by op position, for the bridges that
read every op at once (validation, saving, interventions, the viewer).  ``Trace`` derives from it; the
columns are the trace's own lists, read-only: never mutate what these return."""

from __future__ import annotations

from ..checks import as_position, check_int
from .columns import Kind


class TraceColumns:
    """Per-op and per-call columns of a ``Trace`` (set by ``Trace.__init__`` and ``Trace.relabel``)."""

    @property
    def kinds(self) -> list:
        """Each op's ``record.columns.Kind`` (OP, INPUT, BUFFER, OUTPUT), by op index."""
        return self._kind

    @property
    def call_indices(self) -> list:
        """Each op's position in ``calls`` (-1 for inputs, buffers and outputs), by op index."""
        return self._call

    @property
    def op_meta(self) -> list:
        """Each op's tensor metadata (``record.columns.OpMeta``: ``.shape``, ``.dtype``, ``.device``,
        ``.requires_grad``, ``.grad_fn_class``), by op index."""
        return self._meta

    @property
    def interventions(self) -> list:
        """What interventions applied (``.site``, ``.action``, ``.label``), in op order."""
        return [self._applied_at(index) for index in sorted(self._interventions)]

    def _applied_at(self, index: int):
        """The intervention applied at op ``index``, or None; its ``label`` filled in when first read from the
        trace, so that an intervened trace, like a plain one, derives its labels only when they are read."""
        applied = self._interventions.get(index)
        if applied is not None and applied.label is None:
            applied.label = self.labels[index]
        return applied

    @property
    def labels(self) -> list:
        """Each op's label (``relu_1_2:3``), by op index (the column itself; ``op_labels`` copies it)."""
        return self._labels

    @property
    def op_layer_labels(self) -> list:
        """Each op's layer label (``relu_1_2``), by op index."""
        return self._layer_labels

    @property
    def module_call_indices(self) -> list:
        """Each op's innermost module call, an index into ``module_calls`` (-1: the root forward), by op index."""
        return self._module_call

    @property
    def module_call_parents(self) -> list:
        """Each module call's enclosing call, an index into ``module_calls`` (-1: the root forward), by call index."""
        return [row.parent for row in self._call_rows]

    @property
    def op_parents(self) -> list:
        """Each op's ``((argument position, parent op index), ...)`` (-1: a tensor of unknown origin), by op index."""
        return self._parents

    def output_producer(self, index: int) -> int:
        """The op an output node shows (its one parent: an op, or the input returned as it is), or -1 for a
        tensor the trace has no op for (a parameter returned as it is)."""
        index = self._output_node(index)
        return self._parents[index][0][1]

    def _output_node(self, index) -> int:
        """``index`` when it is the position of an output node; any other op's first parent would read as a
        plausible, wrong producer, so anything else is refused naming the trace's output nodes."""
        position = as_position(index)
        count = len(self._kind)
        if type(position) is int and -count <= position < count and self._kind[position] == Kind.OUTPUT:
            return position % count
        # The output nodes are listed on refusal only: the bridges call this once per output node.
        outputs = [i for i, kind in enumerate(self._kind) if kind == Kind.OUTPUT]
        advice = f"give the op index of an output node: this trace's are {outputs} (log.outputs[k].index)"
        check_int(position, "index", advice, who="output_producer")
        raise ValueError(f"output_producer: index={position} is not an output node; {advice}")

    @property
    def pass_numbers(self) -> list:
        """Each op's pass number within its layer (1-based), by op index."""
        return self._pass

    @property
    def groups(self) -> list:
        """Each op's layer group: ops of one group are passes of one layer, by op index."""
        return self._group

    @property
    def group_sizes(self) -> dict:
        """Layer group -> how many passes (ops) it has."""
        return self._group_size

    @property
    def op_types(self) -> list:
        """Each op's type (``linear``, ``input``, ``output``), by op index."""
        return self._types

    @property
    def func_names(self) -> list:
        """Each op's torch function name (``linear``, ``__add__``), by op index."""
        return self._func_names

    @property
    def slots(self) -> list:
        """Each op's slot: None for a call's output, the input path or buffer address for a source."""
        return self._slot

    @property
    def inplace_flags(self) -> list:
        """Each op's flag: whether its call wrote a tensor argument, by op index."""
        return self._inplace

    @property
    def io_paths(self) -> dict:
        """Op index -> the path of a model input, buffer or output (``input.x``, ``output.0``)."""
        return self._io

    @property
    def saved_activations(self) -> dict:
        """Op index -> its saved tensor, for the ops whose activation was kept (empty after ``cleanup``)."""
        return self._activations

    @property
    def finite_flags(self) -> dict:
        """Op index -> (has NaN, has Inf), for ops examined under ``record_finite=True``."""
        return self._finite

    @property
    def param_addresses(self) -> dict:
        """Op index -> the addresses of the parameters its call used."""
        return self._param_addresses

    @property
    def alias_reads(self) -> frozenset:
        """``(call index, parent op index)`` pairs where a call read a storage written through a view."""
        return self._alias_reads
