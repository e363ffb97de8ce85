"""Analytic forward FLOPs for captured ops, from a registry of per-function formulas.

Convention: a multiply-add counts 2 FLOPs; every other arithmetic operation counts 1, and an elementwise
function (``exp``, ``gelu``, a comparison) counts 1 per output element whatever its kernel does inside.
A formula reads only shapes and non-tensor arguments, never values, so counts are metadata: they stay
available after ``Trace.cleanup()``.  An op whose function has no formula, or whose formula lacks a shape
it needs, is *unknown*: it is listed, never counted as 0 (so is an op that ran inside ``torch.vmap``, whose recorded
shapes are one example's).  Ops that only move or create data (views,
``cat``, ``zeros``) have a formula, and it says 0.

The registry is keyed by the torch function's canonical name, so ``torch.add``, ``Tensor.add``,
``Tensor.add_``, ``x + y`` and ``y + x`` share one entry.  Each formula credits its FLOPs to one or more
families (``matmul``, ``conv``, ``attention``, ``elementwise``, ``other``) so that reports can compare
like with like.  A call with several outputs (``torch.max(x, dim)``, ``lstm``) is counted once, on its
first output.
"""

from __future__ import annotations

import math

from ..errors import counted, listed
from ..record.columns import is_first_output, per_example_ops
from ..record.modules import enclosing_calls, inclusive_totals, script_modules
from ..record.op import Layer, Op
from ..record.trace import checked_trace
from .flops_einsum import einsum_flops
from .flops_fft import fft_flops
from .flops_products import (bilinear_flops, cdist_flops, chain_matmul_flops, conv_tbc_flops, matrix_power_flops,
                             multi_dot_flops, tensordot_flops, vecdot_flops)

CONVENTION = ("analytic forward FLOPs: a multiply-add counts 2, any other arithmetic operation 1, "
              "an elementwise function 1 per output element")
FAMILIES = ("matmul", "conv", "attention", "elementwise", "other")

_BINARY_DUNDERS = frozenset(["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
                             "lshift", "rshift", "div"])


def canonical_name(func_name: str) -> str:
    """``__iadd__``/``__radd__``/``add_`` -> ``add``; ``__rmatmul__`` stays distinct (operands swap); an operator
    overload called directly (``add_.Tensor``) -> its operator's name (``add``)."""
    func_name = func_name.partition(".")[0]
    if func_name.startswith("__") and func_name.endswith("__"):
        inner = func_name[2:-2]
        if inner in ("rmatmul", "imatmul"):
            return "rmatmul" if inner == "rmatmul" else "matmul"
        if inner[:1] in ("r", "i") and inner[1:] in _BINARY_DUNDERS:
            return inner[1:]
        return inner
    if func_name.endswith("_") and not func_name.startswith("_"):
        return func_name[:-1]
    return func_name


class CallArgs:
    """Shapes and non-tensor arguments of one captured call, read by formulas."""

    __slots__ = ("_trace", "_call", "_position", "out_shape")

    def __init__(self, trace, position, out_shape):
        self._trace = trace
        self._call = trace.calls[position]
        self._position = position
        self.out_shape = tuple(out_shape)

    def _parent_shape(self, parent):
        """The shape of the tensor read from record ``parent``; None when it is not that record's: a tensor from
        outside the trace, or one read through an alias after a write (the base of a view written in place,
        whose parent is the write, with the view's shape)."""
        if parent < 0 or (self._position, parent) in self._trace.alias_reads:
            return None
        return tuple(self._trace.op_meta[parent].shape)

    @property
    def out_numel(self) -> int:
        return math.prod(self.out_shape)

    def shape(self, position, name=None):
        """Shape of the tensor passed at ``position`` (or keyword ``name``); None if absent or unknown."""
        for pos, parent in self._call.parents:
            if pos == position or (name is not None and pos == name):
                return self._parent_shape(parent)
        for pos, param in self._call.params:
            if pos == position or (name is not None and pos == name):
                return tuple(param.shape)
        return None

    def has_tensor(self, position, name=None) -> bool:
        positions = [p for p, _ in self._call.parents] + [p for p, _ in self._call.params]
        return position in positions or (name is not None and name in positions)

    def nested_shapes(self, position=None) -> list:
        """Shapes of the tensors passed inside list arguments (RNN weights, multi_dot's matrices), or inside the
        one at ``position``: in the order passed, parents and parameters alike (None where unknown).  A parameter
        is recorded apart from the parents, so the two are merged by position."""
        found = [(pos, self._parent_shape(p)) for pos, p in self._call.parents if isinstance(pos, tuple)]
        found += [(pos, tuple(p.shape)) for pos, p in self._call.params if isinstance(pos, tuple)]
        return [shape for pos, shape in sorted(found, key=lambda item: item[0]) if position in (None, pos[0])]

    @property
    def arg_count(self) -> int:
        """How many positional arguments the call passed."""
        return len(self._call.args or ())

    def is_list(self, position) -> bool:
        """Whether the positional argument at ``position`` is a list or tuple (of tensors, stripped to None)."""
        args = self._call.args or ()
        return position < len(args) and isinstance(args[position], (list, tuple))

    def value(self, position, name, default=None):
        """A non-tensor argument, positional or keyword."""
        args, kwargs = self._call.args or (), self._call.kwargs or {}
        if name in kwargs:
            return kwargs[name]
        if position is not None and position < len(args) and not self.has_tensor(position):
            return args[position]
        return default


# ----- formulas: each takes CallArgs and returns an int, a {family: int} dict, or None (unknown) ------
def _per_element(cost):
    return lambda a: cost * a.out_numel


def _add_like(a):
    alpha = a.value(2, "alpha", 1)
    return (2 if alpha not in (1, None) else 1) * a.out_numel


def _linear(a):
    weight = a.shape(1, "weight")
    k = weight[-1] if weight else (a.shape(0, "input") or (None,))[-1]
    if k is None:
        return None
    return 2 * a.out_numel * k + (a.out_numel if a.has_tensor(2, "bias") else 0)


def _matmul(a):
    left = a.shape(0, "input")
    return 2 * a.out_numel * left[-1] if left else None


def _rmatmul(a):
    right = a.shape(0)  # Tensor.__rmatmul__(self, other) computes other @ self
    if not right:
        return None
    return 2 * a.out_numel * (right[-2] if len(right) >= 2 else right[0])


def _input_adds(a) -> int:
    """The adds of ``input`` in ``beta * input + alpha * product``: one per output element, none with ``beta=0``,
    where torch reads no input (attention that fills an uninitialized buffer, ``baddbmm(empty, q, k, beta=0)``)."""
    return 0 if a.value(None, "beta", 1) == 0 else a.out_numel


def _addmm(a):
    left = a.shape(1, "mat1") or a.shape(1, "batch1") or a.shape(1, "mat")
    return 2 * a.out_numel * left[-1] + _input_adds(a) if left else None


def _addbmm(a):
    """``input + sum_b batch1[b] @ batch2[b]``: a multiply-add per batch and output element, then the sums."""
    left = a.shape(1, "batch1")
    return 2 * left[0] * left[-1] * a.out_numel + _input_adds(a) if left else None


def _grouped_mm(a):
    """One matmul per group.  With two 2-D operands the groups split the shared dimension, and the output
    stacks one (M, N) block per group; otherwise each output row meets the full shared dimension once."""
    left, right = a.shape(0, "mat_a"), a.shape(1, "mat_b")
    if not left or not right:
        return None
    if len(left) == 2 and len(right) == 2:
        return 2 * (a.out_numel // a.out_shape[0]) * left[-1] if len(a.out_shape) == 3 else None
    return 2 * a.out_numel * left[-1]


def _diff(a):
    """One subtraction per output element for a first difference; higher orders are not modelled."""
    return a.out_numel if a.value(1, "n", 1) == 1 else None


def _einsum(a):
    """Counted as torch computes it (``flops_einsum``); the equation string reaches ``__torch_function__`` also
    from the sublist form ``einsum(x, [0, 1], y, [1, 2])``, which ``torch.einsum`` converts first."""
    equation = a.value(0, "equation")
    shapes = a.nested_shapes(1) if a.is_list(1) else [a.shape(i) for i in range(1, a.arg_count)]
    if not isinstance(equation, str) or not shapes or None in shapes:
        return None
    return einsum_flops(equation, shapes)


def _conv(a):
    weight = a.shape(1, "weight")
    if not weight:
        return None
    bias = a.out_numel if a.has_tensor(2, "bias") else 0
    return 2 * a.out_numel * math.prod(weight[1:]) + bias


def _conv_transpose(a):
    weight, inp = a.shape(1, "weight"), a.shape(0, "input")
    if not weight or not inp:
        return None
    bias = a.out_numel if a.has_tensor(2, "bias") else 0
    return 2 * math.prod(inp) * math.prod(weight[1:]) + bias


def _sdpa(a):
    q, k, v = a.shape(0, "query"), a.shape(1, "key"), a.shape(2, "value")
    if not (q and k and v):
        return None
    # The batch dimensions broadcast (a query of batch 1 against keys of batch B): the output's are those computed.
    batch = math.prod(a.out_shape[:-2])
    return 2 * batch * q[-2] * k[-2] * (q[-1] + v[-1])  # Q @ K^T, then weights @ V


def _multi_head_attention(a):
    q, k, v = a.shape(0, "query"), a.shape(1, "key"), a.shape(2, "value")
    embed = a.value(3, "embed_dim_to_check")
    if not (q and k and v) or not isinstance(embed, int):
        return None
    if a.has_tensor(7, "bias_k") or a.value(9, "add_zero_attn", False):
        return None  # extra key/value rows change the attention shape; not modelled
    rows_q, rows_k, rows_v = math.prod(q) // q[-1], math.prod(k) // k[-1], math.prod(v) // v[-1]
    projections = 2 * embed * (math.prod(q) + math.prod(k) + math.prod(v))
    if a.has_tensor(6, "in_proj_bias"):
        projections += embed * (rows_q + rows_k + rows_v)
    projections += 2 * rows_q * embed * embed + (rows_q * embed if a.has_tensor(12, "out_proj_bias") else 0)
    batch = q[1] if len(q) == 3 else 1
    attention = 2 * 2 * batch * q[0] * k[0] * embed
    return {"matmul": projections, "attention": attention}


def _recurrent(a):
    inp = a.shape(0, "input")
    shapes = a.nested_shapes()
    if not inp or not shapes or None in shapes:
        return None
    rows = math.prod(inp) // inp[-1]  # time steps x batch (or packed rows): every weight sees each once
    weights = sum(math.prod(s) for s in shapes if len(s) == 2)
    biases = sum(math.prod(s) for s in shapes if len(s) == 1)
    return 2 * rows * weights + rows * biases


def _recurrent_cell(a):
    inp = a.shape(0, "input")
    if not inp:
        return None
    rows = math.prod(inp) // inp[-1]
    weights = [a.shape(i) for i in (2, 3)]
    if None in weights:
        return None
    biases = [a.shape(i) for i in (4, 5) if a.has_tensor(i)]
    return 2 * rows * sum(math.prod(w) for w in weights) + rows * sum(math.prod(b) for b in biases)


def _norm(stats_cost, affine_positions):
    def formula(a):
        per = 2 + stats_cost(a) + sum(1 for p, n in affine_positions if a.has_tensor(p, n))
        return per * a.out_numel
    return formula


def _batch_norm_stats(a):
    training = a.value(5, "training", False)
    return 3 if training or not a.has_tensor(1, "running_mean") else 0


def _reduction(cost):
    def formula(a):
        inp = a.shape(0, "input")
        if a.has_tensor(1, "other"):  # torch.max(x, y) is elementwise
            return a.out_numel
        return cost * math.prod(inp) if inp is not None else None
    return formula


def _pool(dims, kernel_position=1):
    """Output elements x window; ``kernel_position``: where ``kernel_size`` sits positionally (2 for
    ``lp_pool``, whose second argument is ``norm_type``)."""
    def formula(a):
        kernel = a.value(kernel_position, "kernel_size")
        if kernel is None:
            return None
        window = kernel ** dims if isinstance(kernel, int) else math.prod(kernel)
        return a.out_numel * window  # each output element reads one window
    return formula


def _adaptive_pool(dims):
    def formula(a):
        inp = a.shape(0, "input")
        if not inp or len(inp) < dims:
            return None
        reads = 1
        for size_in, size_out in zip(inp[-dims:], a.out_shape[-dims:]):
            # torch's windows: start = floor(i*in/out), end = ceil((i+1)*in/out)
            reads *= sum(-(-(i + 1) * size_in // size_out) - (i * size_in // size_out) for i in range(size_out))
        return math.prod(a.out_shape[:-dims]) * reads
    return formula


def dropout_applies(a) -> bool:
    """Whether a dropout call drops anything (and so draws random numbers): in training mode, ``F.dropout``'s
    ``training`` or ``torch.dropout``'s ``train``, with ``p`` above 0."""
    return bool(a.value(2, "training", a.value(None, "train", True)) and a.value(1, "p", 0.5))


def _dropout(a):
    return a.out_numel if dropout_applies(a) else 0


def _weight_norm(a):
    """``v * (g / ||v||)``: a square and an add per element of ``v`` for the norms, a divide per norm, a multiply per
    element (``torch._weight_norm``, what ``nn.utils.weight_norm`` and its parametrization compute)."""
    g = a.shape(1, "g")
    return 3 * a.out_numel + math.prod(g) if g is not None else None


_REGISTRY: dict = {}


def register(names, family, formula) -> None:
    """Add (or replace) the formula for functions by canonical name; ``family`` is one of FAMILIES."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    for name in names.split() if isinstance(names, str) else names:
        _REGISTRY[name] = (family, formula)


register("linear", "matmul", _linear)
register("matmul mm bmm mv dot vdot inner", "matmul", _matmul)
register("rmatmul", "matmul", _rmatmul)
register("addmm addmv baddbmm", "matmul", _addmm)
register("addr", "matmul", lambda a: a.out_numel + _input_adds(a))  # a multiply per element, then the add
register("addbmm", "matmul", _addbmm)
register("_grouped_mm", "matmul", _grouped_mm)
register("multi_dot linalg_multi_dot", "matmul", multi_dot_flops)
register("chain_matmul", "matmul", chain_matmul_flops)
register("tensordot", "matmul", tensordot_flops)
register("matrix_power linalg_matrix_power", "matmul", matrix_power_flops)
register("bilinear", "matmul", bilinear_flops)
register("vecdot linalg_vecdot", "matmul", vecdot_flops)
register("outer ger kron", "elementwise", _per_element(1))
register("cdist", "other", cdist_flops)
register("einsum", "matmul", _einsum)
register("lstm gru rnn_tanh rnn_relu", "matmul", _recurrent)
register("lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell", "matmul", _recurrent_cell)
register("conv1d conv2d conv3d", "conv", _conv)
register("conv_transpose1d conv_transpose2d conv_transpose3d", "conv", _conv_transpose)
register("conv_tbc", "conv", conv_tbc_flops)
register("scaled_dot_product_attention", "attention", _sdpa)
register("multi_head_attention_forward", "attention", _multi_head_attention)
register("add sub rsub subtract", "elementwise", _add_like)
register("""mul multiply div divide truediv true_divide floordiv floor_divide mod remainder fmod pow neg negative
    abs absolute exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal square sin cos tan asin acos atan
    atan2 sinh cosh tanh sigmoid relu relu6 leaky_relu gelu silu mish elu selu celu softplus softsign
    hardtanh hardsigmoid hardswish hardshrink softshrink tanhshrink threshold prelu logsigmoid clamp clip
    clamp_min clamp_max maximum minimum fmax fmin sign sgn floor ceil round trunc frac erf erfc erfinv hypot
    lt le gt ge eq ne less less_equal greater greater_equal equal not_equal logical_and logical_or
    logical_not logical_xor and or xor invert bitwise_and bitwise_or bitwise_xor bitwise_not isnan isinf
    isfinite isposinf isneginf nan_to_num lerp""".split(), "elementwise", _per_element(1))
register("addcmul addcdiv", "elementwise", _per_element(2))
register("diff", "elementwise", _diff)
register("dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d", "elementwise",
         _dropout)
register("batch_norm", "other", _norm(_batch_norm_stats, [(3, "weight"), (4, "bias")]))
register("layer_norm group_norm", "other", _norm(lambda a: 3, [(2, "weight"), (3, "bias")]))
register("instance_norm", "other", _norm(lambda a: 3 if a.value(5, "use_input_stats", True) else 0,
                                         [(3, "weight"), (4, "bias")]))
register("rms_norm", "other", lambda a: (3 + a.has_tensor(2, "weight")) * a.out_numel)  # square, add, scale
register("normalize", "other", _per_element(3))
register("_weight_norm", "other", _weight_norm)
for _rank, _suffix in ((1, ""), (2, "2"), (None, "n")):
    for _kind, _names in (("c2c", "fft ifft"), ("r2c", "rfft ihfft"), ("c2r", "irfft hfft")):
        for _name in _names.split():
            register(_name + _suffix, "other", fft_flops(_rank, _kind, _name.startswith("i")))
register("softmax log_softmax softmin", "other", _per_element(5))
register("sum mean nansum nanmean prod amax amin max min argmax argmin all any cumsum cumprod "
         "count_nonzero", "other", _reduction(1))
register("norm linalg_vector_norm linalg_norm vector_norm", "other", _reduction(2))
register("var std var_mean std_mean logsumexp", "other", _reduction(3))
# Pure data movement, selection and creation: their formula is 0.
register("""view view_as reshape reshape_as permute transpose swapaxes swapdims movedim t T mT H mH
    contiguous clone copy detach pos positive flatten unflatten squeeze unsqueeze expand expand_as repeat tile
    cat concat concatenate stack hstack vstack split split_with_sizes chunk unbind narrow select getitem setitem
    index_select gather take masked_fill masked_select where embedding one_hot pad roll flip to float double
    half bfloat16 int long bool type type_as cpu cuda zeros ones empty full zeros_like ones_like empty_like
    full_like arange linspace eye tensor as_tensor rand randn randint rand_like randn_like randint_like
    randperm new_zeros new_ones new_empty new_full new_tensor fill zero tril triu diag diagonal
    unfold as_strided nonzero argwhere repeat_interleave real imag view_as_real view_as_complex conj fftshift
    ifftshift fftfreq rfftfreq broadcast_to broadcast_tensors meshgrid masked_scatter""".split(), "other",
         _per_element(0))
# A scatter only places values, unless it combines them with what is there (reduce="add", "multiply").
register("scatter", "other", lambda a: 0 if a.value(4, "reduce") is None else None)


for _d in (1, 2, 3):
    register([f"max_pool{_d}d", f"max_pool{_d}d_with_indices", f"avg_pool{_d}d"], "other", _pool(_d))
    register([f"lp_pool{_d}d"], "other", _pool(_d, kernel_position=2))
    register([f"adaptive_avg_pool{_d}d", f"adaptive_max_pool{_d}d", f"adaptive_max_pool{_d}d_with_indices"],
             "other", _adaptive_pool(_d))


# An operator overload called directly (``torch.ops.aten.linear.default``, named ``linear.default``: the ops of an
# exported program's module) takes the formula of its operator's name, whose arguments sit where the torch
# function's do, except for the operators below: aten's ``batch_norm`` and ``instance_norm`` take the affine weights
# before the running statistics, where ``F.batch_norm`` takes them after, and the decomposed programs of
# ``run_decompositions()`` call operators no torch function is named after.
_BY_OPERATOR: dict = {}
_ATEN_BATCH_NORM = _norm(lambda a: 3 if a.value(5, "training", False) or not a.has_tensor(3, "running_mean") else 0,
                         [(1, "weight"), (2, "bias")])
for _names, _family, _formula in (
        ("batch_norm native_batch_norm _native_batch_norm_legit", "other", _ATEN_BATCH_NORM),
        ("_native_batch_norm_legit_no_training", "other", _norm(lambda a: 0, [(1, "weight"), (2, "bias")])),
        ("instance_norm", "other", _norm(lambda a: 3 if a.value(5, "use_input_stats", True) else 0,
                                         [(1, "weight"), (2, "bias")])),
        ("native_group_norm", "other", _norm(lambda a: 3, [(1, "weight"), (2, "bias")])),
        ("native_layer_norm", "other", _norm(lambda a: 3, [(2, "weight"), (3, "bias")])),
        ("convolution _convolution", "conv", lambda a: (_conv_transpose if a.value(6, "transposed") else _conv)(a)),
        ("_softmax _log_softmax", "other", _per_element(5))):
    for _name in _names.split():
        _BY_OPERATOR[_name] = (_family, _formula)


def _entry(func_name: str, func=None):
    """``(family, formula)`` for a function's name, or None.  ``func``, when known, is the function itself: an
    overload of another namespace than aten (a custom ``mylib::linear``) has no formula, whatever its name."""
    operator, overload, _ = func_name.partition(".")
    if not overload:
        return _REGISTRY.get(canonical_name(func_name))
    if func is not None and getattr(func, "namespace", None) != "aten":
        return None
    return _BY_OPERATOR.get(operator) or _REGISTRY.get(canonical_name(func_name))


# ----- per-op evaluation -------------------------------------------------------------------------------
def registry_family(func_name: str):
    """The family a function's formula credits (one of FAMILIES), or None when no formula covers it."""
    entry = _entry(func_name)
    return entry[0] if entry else None


def _evaluate(trace, index, per_example: frozenset):
    """``{family: flops}`` for op ``index``; ``{}`` for pseudo-ops and secondary outputs; None if unknown (also for
    an op in ``per_example``, inside vmap, whose shapes are one example's)."""
    if not is_first_output(trace, index):
        return {}  # not a call's output, or a further output of one: the call was counted on its first output
    position = trace.call_indices[index]
    entry = _entry(trace.func_names[index], trace.calls[position].func)
    if entry is None or index in per_example:
        return None
    family, formula = entry
    try:
        result = formula(CallArgs(trace, position, trace.op_meta[index].shape))
    except Exception:  # an argument layout the formula does not understand: unknown, never 0
        result = None
    if result is None:
        return None
    return dict(result) if isinstance(result, dict) else {family: int(result)}


def flops_column(trace) -> list:
    """Per op index: ``{family: flops}`` or None (unknown).  Computed once per trace and kept."""
    column = trace._flops_col
    if column is None:
        if trace.is_cleaned_up:
            raise RuntimeError("this trace was cleaned up before its FLOPs were derived")
        per_example = per_example_ops(trace)  # derived once for the column: a walk over the ops
        column = [_evaluate(trace, i, per_example) for i in range(len(trace))]
        trace._flops_col = column
    return column


def op_flops(op):
    """Analytic forward FLOPs of one op (int), or None when no formula covers it.

    Inputs, buffers and outputs compute nothing (0); further outputs of a multi-output call are 0 because
    the call is counted on its first output.
    """
    _check_op(op)
    parts = flops_column(op._trace)[op.index]
    return None if parts is None else sum(parts.values())


def _check_op(op) -> None:
    """An op (or a layer, its op) of a trace: a module call's ``index`` counts module calls, not ops, so it
    would read another op's FLOPs (or fail on an index past the ops)."""
    if not isinstance(op, (Op, Layer)):
        raise TypeError(f"op_flops takes an op of a trace (log['linear_1_1'], or a layer), got {type(op).__name__}; "
                        "for a module call's FLOPs read log.summary()['encoder.layers.0:1']['flops']")
    if isinstance(op, Layer) and op.num_passes > 1:  # a layer is its op only when it ran once
        label = op.layer_label
        raise ValueError(f"op_flops: layer {label} ran {op.num_passes} passes, each counted on its own: give one "
                         f"pass (log['{label}:1']), or sum(op_flops(op) for op in log['{label}'].ops) for them all")


def op_flops_by_family(op):
    """``{family: flops}`` for one op, or None when unknown."""
    _check_op(op)
    parts = flops_column(op._trace)[op.index]
    return None if parts is None else dict(parts)


class FlopCount(int):
    """A FLOP total (an int) that also names the ops it could not count (``unknown``) and the TorchScript
    modules whose ops capture never saw (``hidden``): a total is ``complete`` when it has neither."""

    def __new__(cls, total: int, unknown=(), counted: int = 0, hidden=()):
        self = super().__new__(cls, total)
        self.unknown = tuple(unknown)
        self.counted = counted
        self.hidden = tuple(hidden)
        return self

    @property
    def complete(self) -> bool:
        return not self.unknown and not self.hidden

    def __repr__(self) -> str:
        if self.complete:
            return f"{int(self):,} FLOPs"
        parts = [f"{int(self):,} FLOPs over {counted(self.counted, 'counted op')}"]
        if self.unknown:
            parts.append(f"{counted(len(self.unknown), 'op')} unknown: {listed(self.unknown, 5)}")
        if self.hidden:
            parts.append(f"not counted inside TorchScript modules {listed(self.hidden, 5)}")
        return "; ".join(parts)

    __str__ = __repr__


def total_flops(trace) -> FlopCount:
    """Sum of analytic forward FLOPs over every op; ``.unknown`` lists ops with no formula."""
    column = flops_column(checked_trace(trace, "total_flops"))
    total, counted, unknown = 0, 0, []
    for i, parts in enumerate(column):
        if parts is None:
            unknown.append(trace.labels[i])
        elif parts:
            total += sum(parts.values())
            counted += 1
    return FlopCount(total, unknown, counted, script_modules(trace))


def module_call_flops(trace) -> dict:
    """``{module call label: FlopCount}``, inclusive of nested calls, in call order."""
    column = flops_column(checked_trace(trace, "module_call_flops"))
    calls, parents = trace.module_calls, trace.module_call_parents
    totals = inclusive_totals(trace, [sum(parts.values()) if parts else 0 for parts in column])
    counted = inclusive_totals(trace, [1 if parts else 0 for parts in column])
    unknown = [[] for _ in calls]
    for i, m in enumerate(trace.module_call_indices):
        if column[i] is None:
            for k in enclosing_calls(m, parents.__getitem__):
                unknown[k].append(trace.labels[i])
    hidden = [[] for _ in calls]
    for address, call_indices in script_modules(trace).items():
        for c in call_indices:
            for k in enclosing_calls(c, parents.__getitem__):
                hidden[k].append(address)
    return {call.label: FlopCount(totals[k], unknown[k], counted[k], dict.fromkeys(hidden[k]))
            for k, call in enumerate(calls)}


def family_totals(trace) -> dict:
    """``{family: flops}`` over the whole trace (unknown ops are in ``total_flops(trace).unknown``)."""
    totals = dict.fromkeys(FAMILIES, 0)
    for parts in flops_column(checked_trace(trace, "family_totals")):
        for family, n in (parts or {}).items():
            totals[family] += n
    return totals
