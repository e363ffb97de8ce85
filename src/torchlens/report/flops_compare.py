"""``flops_vs_dispatch``: torchlens's analytic FLOPs beside ``torch.utils.flop_counter.FlopCounterMode``.

Two formula registries, two separate executions.  One execution is traced and every captured op is
counted by ``torchlens.report.flops``; the other runs the model untraced under ``FlopCounterMode``, which
counts per dispatched ATen overload.  RNG (CPU and CUDA), parameters and buffers and training flags are
restored before the second run and again afterwards, and the two outputs must agree (the witness that
both executions ran the same program); a forward that draws random numbers is refused, since restoring
the global generators cannot make its draws a proof of anything.

The two sides are reported side by side, by total, by op family and by module, with the signed
difference ``native - torchlens``.  Neither side fills the other's gaps and neither is a measurement:
both are formulas applied to shapes.
"""

from __future__ import annotations

import contextlib

import torch

from ..checks import check_model, check_number
from ..copies import clone_call
from ..errors import NativeToolFailed, WitnessFailed, listed
from ..labels.naming import func_name_of
from ..record.modules import enclosing_calls, is_unregistered
from ..record.summary import aligned_lines
from ..tree import as_args, as_kwargs, structures_equal, tensor_leaves, without_values
from .flops import CONVENTION, FAMILIES, canonical_name, family_totals, flops_column, registry_family, total_flops
from .flops_notes import drawn_by, randomness_advice, script_notes, unknown_notes

NATIVE_CONVENTION = ("FlopCounterMode: per dispatched ATen overload in its flop_registry (matrix products, "
                     "convolutions, some attention kernels); a multiply-add counts 2; every other overload "
                     "counts nothing")
SDPA_CPU_NOTE = ("FlopCounterMode counts 0 for scaled_dot_product_attention on CPU in torch 2.13, called directly or "
                 "inside multi_head_attention_forward: the CPU "
                 "kernel (aten._scaled_dot_product_flash_attention_for_cpu) has no entry in its flop "
                 "registry. The native attention family is missing that work, not free.")
BATCHED_ATTENTION_NOTE = ("FlopCounterMode counted these attention calls through their batched matrix products "
                          "(aten.bmm/baddbmm: the math fallback of scaled_dot_product_attention, taken for "
                          "example when the mask requires grad, or multi_head_attention_forward with "
                          "need_weights): those FLOPs are in the native attention family, not matmul.")
UNNAMED_MODULES_NOTE = ("module rows shown n/a on the native side: FlopCounterMode's module tracker names a module "
                        "by its class alone when it meets it outside the root module's own call (a function given "
                        "no root= the module it runs, a module run before the root's call, or one outside the "
                        "root's submodules; a module of its class is n/a too), merging every "
                        "instance of that class, so those rows have no native figure of their own; the root row "
                        "is FlopCounterMode's whole-call total.")
NO_VALUES_NOTE = ("the outputs hold no values (meta or fake tensors): the two executions' outputs were compared by "
                  "shape and dtype only, so the witness that they ran the same program is their calling the same "
                  "matrix products, convolutions and attention in the same order.")
# The attention functions whose batched matrix products (bmm, baddbmm) are the attention products; their
# projections, if any, are unbatched (mm, addmm) and stay matmul, as torchlens's formulas split them.
_ATTENTION_FUNCTIONS = ("scaled_dot_product_attention", "multi_head_attention_forward")
_BATCHED_PRODUCTS = ("bmm", "baddbmm")
_NATIVE_FAMILY = {"mm": "matmul", "addmm": "matmul", "bmm": "matmul", "baddbmm": "matmul", "_scaled_mm": "matmul",
                  "convolution": "conv", "_convolution": "conv", "cudnn_convolution": "conv",
                  "convolution_overrideable": "conv", "_slow_conv2d_forward": "conv",
                  "convolution_backward": "conv"}


class FlopsComparison:
    """Both registries' FLOPs for one forward, side by side; see ``flops_vs_dispatch``."""

    def __init__(self, model_name, torchlens_total, native_total, families, modules, native_by_overload,
                 notes, witness):
        self.model_name = model_name
        self.torchlens_total = torchlens_total
        self.native_total = native_total
        self.families = families
        self.modules = modules
        self.native_by_overload = native_by_overload
        self.notes = notes
        self.witness = witness
        self.convention = {"torchlens": CONVENTION, "native": NATIVE_CONVENTION}

    @property
    def difference(self) -> int:
        """``native - torchlens`` over the whole forward."""
        return self.native_total - int(self.torchlens_total)

    @property
    def torchlens_unknown(self) -> tuple:
        """Labels of captured ops with no torchlens formula (missing from the torchlens side)."""
        return self.torchlens_total.unknown

    def to_pandas(self, table: str = "family"):
        """``table="family"`` (default) or ``"module"``, one row each."""
        from ..record.tables import require_pandas

        if table not in ("family", "module"):
            raise ValueError(f"table must be 'family' or 'module', got {table!r}")
        return require_pandas().DataFrame(self.families if table == "family" else self.modules)

    def __str__(self) -> str:
        table = [["", "torchlens", "native", "native-tl"],
                 ["total", f"{int(self.torchlens_total):,}", f"{self.native_total:,}", f"{self.difference:,}"]]
        table += [[row["family"], f"{row['torchlens']:,}", f"{row['native']:,}", f"{row['difference']:,}"]
                  for row in self.families]
        table += [[row["module"], f"{row['torchlens']:,}", _shown(row["native"]), _shown(row["difference"])]
                  for row in self.modules]
        # One table, so the module rows line up with the families'; the module rows get their heading between.
        rows = ["  " + line for line in aligned_lines(table, right=(1, 2, 3))]
        families = 2 + len(self.families)
        lines = [f"FLOPs of {self.model_name}: two formula registries, never measured", *rows[:families],
                 "  by module (inclusive; calls of one module merged, as FlopCounterMode does):", *rows[families:]]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _shown(value) -> str:
    """A count with thousands separators, or ``n/a`` where the side has no figure."""
    return "n/a" if value is None else f"{value:,}"


def _check_tolerances(rtol, atol) -> None:
    """The tolerances the two runs' outputs are compared with, checked before either run: a string or NaN would
    fail only inside ``torch.allclose``, after both forwards, and a negative one would refuse every output."""
    for name, value in (("rtol", rtol), ("atol", atol)):
        check_number(value, name, "a tolerance is a number, 0 or more (such as 1e-5)", who="flops_vs_dispatch",
                     at_least=0)


def flops_vs_dispatch(model, args=(), kwargs=None, *, rtol: float = 1e-5, atol: float = 1e-6,
                      root=None) -> FlopsComparison:
    """Count ``model(*args, **kwargs)``'s forward FLOPs with torchlens's registry and with
    ``FlopCounterMode``, in two separate executions, and report both side by side.

    Raises ``WitnessFailed`` when the two executions cannot be shown to have run the same program: the
    forward drew random numbers (e.g. dropout in training mode), the outputs differ, or they called
    different products (matrix products, convolutions, attention).  ``root``: for a callable that is not a
    module (``lambda **k: m.generate(**k)``), the module it runs, as for ``tl.trace``: its modules' rows are
    named by their addresses in it, and FlopCounterMode's rows matched to them.
    """
    from ..capture.session import trace
    from ..capture.wrappers import unwrap
    from ..capture.restore import RunState, module_run_by
    from ..validate import refuse_unmaterialized

    _check_tolerances(rtol, atol)
    _refuse_a_trace(model)
    check_model(model, "tl.report.flops_vs_dispatch")
    model = unwrap(model)
    call_args = as_args(args)
    kwargs = dict(as_kwargs(kwargs, "tl.report.flops_vs_dispatch"))
    refuse_unmaterialized(root if root is not None else module_run_by(model), "tl.report.flops_vs_dispatch")
    saved = RunState(model, root)
    try:
        with saved.watching:
            log = trace(model, *clone_call(call_args, kwargs), save="none", root=root)
        traced_output = _detached(log.output)
        drew = saved.rng.moved_generators()
        if drew:
            raise WitnessFailed(
                f"flops_vs_dispatch refused: the forward draws random numbers ({drawn_by(log, drew)})"
                ", so matching outputs would rest on both executions drawing the same numbers in the same "
                f"order, which restoring the global generators cannot guarantee. {randomness_advice(model)}")
        saved.restore()
        with saved.watching:
            counter, native_output, product_calls, unknown_counted = _count_natively(
                model, *clone_call(call_args, kwargs), _unknown_names(log))
    finally:
        saved.restore()
    outputs_match = _outputs_close(traced_output, native_output, rtol, atol)
    if outputs_match is False:
        raise WitnessFailed(
            "flops_vs_dispatch refused: the traced execution and the FlopCounterMode execution returned "
            "different outputs, so they did not run the same program and their FLOPs are not comparable. "
            "Make the forward deterministic (eval mode, no data-dependent randomness) and compare again.")
    traced_products, counted_products = _traced_products(log), [name for name, _ in product_calls]
    if [op.func_name for op, _ in traced_products] != counted_products:
        raise WitnessFailed(
            "flops_vs_dispatch refused: the traced execution and the FlopCounterMode execution returned the same "
            f"outputs but called different matrix products, convolutions or attention ({len(traced_products)} "
            f"against {len(counted_products)}), so they did not run the same program. Make the forward's control "
            "flow depend on its inputs alone and compare again.")
    return _compare(log, root if root is not None else module_run_by(model) or model, counter.get_flop_counts(),
                    product_calls, traced_products, outputs_match, unknown_counted)


def _refuse_a_trace(model) -> None:
    """A trace in the model's place: both executions are run here, from the model, so a trace cannot stand in
    for it (it failed inside tl.trace, naming neither this function nor what to give)."""
    from ..record.trace import Trace

    if isinstance(model, Trace):
        raise TypeError("flops_vs_dispatch takes the model and its inputs, not a Trace: it runs the model twice "
                        "itself, once traced and once under FlopCounterMode (tl.report.flops_vs_dispatch(model, x)); "
                        "for an existing trace's FLOPs read log.flops")


def _unknown_names(log) -> frozenset:
    """Function names of the traced ops torchlens has no formula for (not those of an op whose formula lacked a
    shape, a product among them, which the witness pairs with the counted run's products)."""
    names = (log._by_label(label).func_name for label in total_flops(log).unknown)
    return frozenset(name for name in names if registry_family(name) is None)


def _count_natively(model, args, kwargs, unknown_names=frozenset()):
    """``(counter, output, product calls, unknown counted)`` of one untraced run under ``FlopCounterMode``;
    the last two are ``_ProductWatch.calls`` and ``_ProductWatch.unknown_counted``.

    Its module tracker hooks, for backward attribution, every module input that requires gradients. With
    gradients off, a view of a parameter handed to a submodule (DeBERTa's relative embeddings) has no
    gradient node to hook, and torch 2.13's tracker fails on it with a bare assertion: named here, with
    the way round it.  A forward taking a gradient with respect to a leaf a module received (a physics-informed
    loss) fails in that hook with a bare RuntimeError: named here too."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..capture.fastpath import FastPathShim

    try:
        with FlopCounterMode(display=False) as counter, _ProductWatch(counter, unknown_names) as watch, \
                FastPathShim(watch), _unwatched_compiled_calls(watch):
            return counter, _detached(model(*args, **kwargs)), watch.calls, watch.unknown_counted
    except TypeError as error:
        if "__torch_dispatch__ handlers returned NotImplemented" not in str(error):
            raise
        raise NativeToolFailed(
            "flops_vs_dispatch: FlopCounterMode could not run this forward: its dispatch mode handles no tensor "
            f"subclass of the kind met here ({str(error).splitlines()[0]}), a jagged nested tensor for one (a "
            "limitation of torch.utils.flop_counter). torchlens's own count needs no second run: "
            "tl.trace(model, x).flops.") from error
    except AssertionError as error:
        if torch.is_grad_enabled() or str(error) != "Expected gradient function to be set":
            raise
        raise NativeToolFailed(
            "flops_vs_dispatch: FlopCounterMode's module tracker failed on this model under torch.no_grad(): "
            "a module was handed a view of a parameter made with gradients off, which has no gradient node "
            "for the tracker's backward hook (a limitation of torch.utils.module_tracker). Call "
            "flops_vs_dispatch outside torch.no_grad().") from error
    except RuntimeError as error:
        if "_will_engine_execute_node" not in str(error):
            raise
        raise NativeToolFailed(_GRAD_IN_FORWARD) from error


# torch 2.13's module tracker hooks the backward of every module input that requires gradients; a backward the
# forward runs itself (autograd.grad) then reaches that hook for a leaf, which the engine refuses to answer for.
_GRAD_IN_FORWARD = (
    "flops_vs_dispatch: FlopCounterMode's module tracker failed on this forward: it takes a gradient itself "
    "(torch.autograd.grad, or a torch.func transform such as grad, jacrev or vjp) with respect to a leaf tensor "
    "that a module received, and the tracker's backward hook on that input cannot run inside autograd.grad (a "
    "limitation of torch.utils.module_tracker). torchlens's own count needs no second run: "
    "tl.trace(model, x).flops.")


@contextlib.contextmanager
def _unwatched_compiled_calls(watch):
    """Hides from ``watch`` the products a ``torch.compile``'d submodule runs: capture records its call as one op
    (``compiled``, with no formula) and sees nothing inside it, so the watch must not list them either, or the
    two runs' product sequences differ and the comparison refuses the model as running another program."""
    from ..capture.compiled import optimized_module_type

    compiled = optimized_module_type() or ()  # () when Dynamo was never imported: no module is compiled

    def enter(module, args):
        if isinstance(module, compiled):
            watch._depth += 1

    def leave(module, args, output):
        if isinstance(module, compiled):
            watch._depth -= 1

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class _ProductWatch(torch.overrides.TorchFunctionMode):
    """Per outermost call of a function torchlens counts as a product (its matmul, conv and attention
    families), the FLOPs per overload that ``FlopCounterMode`` counted inside it.

    FlopCounterMode names only the overload.  An attention call that falls back to batched matrix
    products (the math path of scaled_dot_product_attention, or multi_head_attention_forward with
    ``need_weights``) is counted as ``aten.bmm``, the same overload as any other batched product: which
    call those FLOPs came from is the only way to put them in the attention family, where torchlens's
    formulas put the same work.  And a product whose kernel has no entry in FlopCounterMode's registry
    (``addbmm``, a matrix times a vector) shows as a call it counted nothing for.  So do the functions
    torchlens has no formula for (``unknown_names``), summed per name in ``unknown_counted``: a fused kernel
    such as ``_transformer_encoder_layer_fwd`` that FlopCounterMode also counts nothing for has no figure on
    either side, which its 0 in the native column would otherwise hide.

    Like capture's own mode, it runs under ``FastPathShim``: an active mode would otherwise turn off the
    fused fast paths of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` (``has_torch_function``)
    and make the counted run another program than the traced one."""

    def __init__(self, counter, unknown_names=frozenset()):
        super().__init__()
        self.counter = counter
        self.calls: list = []  # [(function name, {overload: FLOPs counted inside the call})]
        self.unknown_names = unknown_names
        self.unknown_counted: dict = {}  # {function name: FLOPs counted inside its calls}
        self._depth = 0
        self._dispatch_modes = 0

    def __enter__(self):
        self._dispatch_modes = torch._C._len_torch_dispatch_stack()  # FlopCounterMode's among them
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Named as capture names its ops (torch.linalg.multi_dot's builtin is ``linalg_multi_dot``, its op's
        # ``multi_dot``): the witness compares these names with the traced ops' in order.
        name = func_name_of(func)
        # FlopCounterMode, off its stack while it handles an overload, calls it from Python: an op that reached
        # only the dispatcher (inside a TorchScript module) is no call capture sees, though named like an
        # exported program's (``linear.default``).
        if self._depth or not (_is_product(name) or name in self.unknown_names) \
                or torch._C._len_torch_dispatch_stack() < self._dispatch_modes:
            return func(*args, **(kwargs or {}))
        before = _global_counts(self.counter)
        self._depth += 1
        try:
            result = func(*args, **(kwargs or {}))
        finally:
            self._depth -= 1
        after = _global_counts(self.counter)
        counted = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        if name in self.unknown_names:
            self.unknown_counted[name] = self.unknown_counted.get(name, 0) + sum(counted.values())
        if _is_product(name):
            # Still a product call when some of its calls have no formula (one that read an operand through
            # an alias): the traced side lists every product op, counted or not, and the lists are compared in order.
            self.calls.append((name, counted))
        return result


def _is_product(func_name: str) -> bool:
    return registry_family(func_name) in ("matmul", "conv", "attention")


def _global_counts(counter) -> dict:
    """``{overload name: FLOPs}`` FlopCounterMode has counted so far, over the whole forward.

    Read twice per product call, so it reads the global table alone: ``get_flop_counts()`` copies the table
    of every module counted so far, which made a forward of n products and modules n * n work."""
    tables = getattr(counter, "flop_counts", None)
    if not isinstance(tables, dict):  # a FlopCounterMode without the attribute: its public copy
        tables = counter.get_flop_counts()
    return {str(k): int(v) for k, v in tables.get("Global", {}).items()}


def _attention_products(attention_calls) -> dict:
    """``{overload name: FLOPs}`` of the batched matrix products counted inside attention calls."""
    moved: dict = {}
    for _, counts in attention_calls:
        for overload, count in counts.items():
            if overload.split(".", 1)[-1] in _BATCHED_PRODUCTS:
                moved[overload] = moved.get(overload, 0) + count
    return moved


def _native_families(native_global, attention_calls) -> dict:
    """``{family: FlopCounterMode FLOPs}``: by overload name, except that batched matrix products counted
    inside an attention call are attention, as torchlens's attention formulas count them."""
    families = dict.fromkeys(FAMILIES, 0)
    for overload, count in native_global.items():
        families[_native_family(overload)] += count
    for overload, count in _attention_products(attention_calls).items():
        families[_native_family(overload)] -= count
        families["attention"] += count
    return families


def _compare(log, model, native_counts, product_calls, traced_products, outputs_match=True,
             unknown_counted=None) -> FlopsComparison:
    attention_calls = [call for call in product_calls if canonical_name(call[0]) in _ATTENTION_FUNCTIONS]
    tl_total = total_flops(log)
    root_name = type(model).__name__
    native_global = {str(k): int(v) for k, v in native_counts.get("Global", {}).items()}
    native_families = _native_families(native_global, attention_calls)
    tl_families = family_totals(log)
    families = [{"family": f, "torchlens": tl_families[f], "native": native_families[f],
                 "difference": native_families[f] - tl_families[f]} for f in FAMILIES]
    modules = _module_rows(log, native_counts, root_name)
    notes = _notes(log, tl_total, tl_families, native_families, attention_calls, unknown_counted or {})
    notes += _uncounted_product_notes(log, traced_products, product_calls) + script_notes(log)
    if any(row["native"] is None for row in modules):
        notes.append(UNNAMED_MODULES_NOTE)
    if outputs_match is None:
        notes.append(NO_VALUES_NOTE)
    witness = {"outputs_match": outputs_match, "products_match": True, "random_draws": False, "rng_restored": True,
               "training_flags_restored": True, "buffers_restored": True}
    return FlopsComparison(log.model_name, tl_total, sum(native_global.values()), families, modules,
                           native_global, notes, witness)


def _module_rows(log, native_counts, root_name) -> list:
    """Inclusive totals per module address; each op counts once per module on its stack (set semantics,
    as FlopCounterMode's module tracker has)."""
    column = flops_column(log)
    tl: dict = {"": 0}
    unknown: dict = {"": 0}
    for module in log.modules:
        tl[module.address] = 0
        unknown[module.address] = 0
    calls, parent_of = log.module_calls, log.module_call_parents.__getitem__
    for i, m in enumerate(log.module_call_indices):
        if log.call_indices[i] < 0:
            continue
        parts = column[i]
        addresses = {"", *(calls[k].module.address for k in enclosing_calls(m, parent_of))}
        for address in addresses:
            if parts is None:
                unknown[address] += 1
            else:
                tl[address] += sum(parts.values())
    native = _native_by_address(log, native_counts, root_name)
    return [{"module": address or f"(root {log.model_name})", "torchlens": tl[address],
             "native": native[address], "difference": _signed_difference(native[address], tl[address]),
             "torchlens_unknown_ops": unknown[address]} for address in tl]


def _native_by_address(log, native_counts, root_name) -> dict:
    """FlopCounterMode's inclusive FLOPs per torchlens module address, ``""`` for the root.

    The root is the whole call, so its figure is FlopCounterMode's ``Global`` row (a plain function or a
    bound method has no module call of its own for the tracker to name).  The tracker names each module
    it meets first by bare class name, and its children from there: only when it entered the root
    module itself are its names the root's paths.  Otherwise (a function, a bound method), and for a
    module outside the root's tree (``<unregistered ...>``, whose instances of one class it merges), a
    row has None: no native figure is that module's own.  So has a row whose class (or an enclosing module's)
    the tracker met outside the root first (a generate loop calling the encoder before the model): that
    module and its children carry the class's name, not their paths."""
    by_alias = {alias: module.address for module in log.modules for alias in module.all_addresses}
    total = sum(int(v) for v in native_counts.get("Global", {}).values())
    named_from_root = root_name in native_counts or total == 0
    met_outside = {name.split(".", 1)[0] for name in native_counts if name != "Global"} - {root_name}
    class_of = {module.address: module.class_name for module in log.modules}  # a ModuleList never called: none
    native = {module.address: None if is_unregistered(module.address) or not named_from_root
              or _named_by_class(class_of, module.address, met_outside) else 0 for module in log.modules}
    native[""] = total
    if native.get("self") is not None:  # a callable's calls of its root (generate's steps): the root's own row
        native["self"] = sum(int(v) for v in native_counts.get(root_name, {}).values())
    for name, counts in native_counts.items():
        if not name.startswith(root_name + "."):
            continue  # the root (Global above), or a module the tracker named by class, from outside the root
        address = by_alias.get(name.split(".", 1)[1])
        if address is not None and native.get(address) is not None:
            native[address] += sum(int(v) for v in counts.values())
    return native


def _named_by_class(class_of: dict, address, classes) -> bool:
    """Whether the module at ``address``, or one enclosing it, is of a class in ``classes`` (by ``class_of``)."""
    parts = address.split(".")
    return any(class_of.get(".".join(parts[:n])) in classes for n in range(1, len(parts) + 1))


def _signed_difference(native, torchlens):
    """``native - torchlens``, None when the native side has no figure."""
    return None if native is None else native - torchlens


def _native_attention_flops(counts) -> int:
    """FLOPs FlopCounterMode put in the attention family inside one attention call: an attention overload's, or
    its batched products'.  The unbatched projections of multi_head_attention_forward (mm, addmm) are matmul."""
    core = sum(count for overload, count in counts.items() if _native_family(overload) == "attention")
    return core + sum(_attention_products([(None, counts)]).values())


def _attention_notes(log, attention_calls) -> list:
    """Which attention calls FlopCounterMode counted nothing for, and which it counted as batched products.

    Captured attention ops and watched calls are paired in order when their numbers agree (both runs ran
    the same program); otherwise the notes give counts without labels."""
    ops = [op for op in log.ops if op.kind == "op" and canonical_name(op.func_name) in _ATTENTION_FUNCTIONS]
    paired = len(ops) == len(attention_calls)
    zero, batched = [], []
    for k, (_, counts) in enumerate(attention_calls):
        label = ops[k].label if paired else None
        if not _native_attention_flops(counts):  # its projections (multi_head_attention_forward) may be counted
            zero.append((label, ops[k].device.type if paired else None))
        elif _attention_products([(None, counts)]):
            batched.append(label)
    notes = []
    uncounted = _which([label for label, _ in zero], len(attention_calls)) if zero else ""
    if zero and all(device in ("cpu", None) for _, device in zero):
        notes.append(SDPA_CPU_NOTE + uncounted)
    elif zero:
        notes.append("FlopCounterMode counted no attention FLOPs inside these attention calls: the native "
                     "attention family is missing that work, not free." + uncounted)
    if batched:
        notes.append(BATCHED_ATTENTION_NOTE + _which(batched, len(attention_calls)))
    return notes


def _uncounted_product_notes(log, ops, product_calls) -> list:
    """The products other than attention (whose own notes name them) that torchlens counts and inside
    which FlopCounterMode counted nothing.  ``ops`` are the captured products (``_traced_products``); they
    and the watched calls pair in order (the witness checked that both runs called the same ones)."""
    missed = [op.label for (op, counted), (name, native) in zip(ops, product_calls)
              if canonical_name(name) not in _ATTENTION_FUNCTIONS and _product_part(counted)
              and not any(native.values())]
    if not missed:
        return []
    names = sorted({log._by_label(label).func_name for label in missed})
    shown = listed(missed, 3)
    return [f"FlopCounterMode counted 0 inside these {', '.join(names)} calls: the ATen kernels they reach "
            "(such as aten.addbmm or aten.mv) have no entry in its flop registry. The native side is missing "
            f"that work, not free (here: {shown}; {len(missed)} of {len(ops)} products)."]


def _product_part(counted) -> int:
    """The FLOPs torchlens credits a product call with in the product families: an einsum that torch computes
    as a multiply (``ij,ij->ij``) is elementwise work, which FlopCounterMode never counts, not a missed product."""
    return sum((counted or {}).get(family, 0) for family in ("matmul", "conv", "attention"))


def _traced_products(log) -> list:
    """``(op, {family: flops})`` for each product call the trace holds (its first output), in order: what
    ``_ProductWatch`` saw in the counted run."""
    column = flops_column(log)
    return [(op, column[i]) for i, op in enumerate(log.ops)
            if op.kind == "op" and op.multi_output_index in (None, 0, (0,)) and _is_product(op.func_name)]


def _which(labels, total) -> str:
    """`` (here: a, b, c; 2 of 5 attention calls)``, labels left out when they could not be paired."""
    named = [label for label in labels if label is not None]
    shown = f"here: {listed(named, 3)}; " if named else ""
    return f" ({shown}{len(labels)} of {total} attention calls)"


def _notes(log, tl_total, tl_families, native_families, attention_calls, unknown_counted) -> list:
    notes = _attention_notes(log, attention_calls)
    for family in FAMILIES:
        if tl_families[family] and not native_families[family]:
            notes.append(f"{family}: counted by torchlens only (FlopCounterMode counted none of these ops)")
        elif native_families[family] and not tl_families[family]:
            notes.append(f"{family}: counted by FlopCounterMode only (torchlens counted none of these ops)")
    return notes + unknown_notes(log, tl_total.unknown, unknown_counted)


def _native_family(overload: str) -> str:
    name = overload.split(".", 1)[-1]
    if "attention" in name:
        return "attention"
    return _NATIVE_FAMILY.get(name, "other")


def _detached(output):
    return [t.detach().clone() for _, t in tensor_leaves(output)]


def _outputs_close(a: list, b: list, rtol: float, atol: float):
    """Whether the two runs returned the same outputs (``tree.structures_equal``, the one comparison of outputs:
    nested tensors by component, sparse ones by value); None when they agree in shapes and dtypes and hold no
    values to compare (a forward on the meta device, or under FakeTensorMode)."""
    if not structures_equal(a, b, exact=False, rtol=rtol, atol=atol)[0]:
        return False
    return None if a and all(without_values(t) for t in a) else True
