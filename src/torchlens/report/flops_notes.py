"""Notes ``flops_vs_dispatch`` adds for work one side of the comparison could not count: ops torchlens left
unknown (no formula, a formula that could not count the call, ops inside ``torch.vmap``) and TorchScript modules,
whose ops capture never sees; and what its refusal of a forward that draws random numbers names."""

from __future__ import annotations

import functools

import torch

from ..errors import counted, listed
from ..record.columns import per_example_ops
from ..record.modules import script_modules
from .flops import CallArgs, canonical_name, dropout_applies, registry_family


def unknown_notes(log, unknown, unknown_counted) -> list:
    """Notes on the ops torchlens left unknown, in two kinds: a function with no formula, and an op whose formula
    could not count that call: a shape it needs was unreadable (an operand read through a view written in place,
    a nested tensor's ragged size), or the call's arguments are ones it does not model (``matrix_power`` with a
    negative exponent, which inverts first).  Naming the second kind as having no formula would say matmul has
    none, and naming it an unread shape would send a user hunting for a write that never happened."""
    ops = [log._by_label(label) for label in unknown]
    batched = per_example_ops(log)
    vmapped = [op.label for op in ops if op.index in batched]
    ops = [op for op in ops if op.index not in batched]
    no_formula = [op for op in ops if registry_family(op.func_name) is None]
    unread = [op.label for op in ops if registry_family(op.func_name) is not None]
    notes = []
    if no_formula:
        names = sorted({op.func_name for op in no_formula})
        neither = [name for name in names if unknown_counted.get(name) == 0]
        notes.append(f"{_ops_have(len(no_formula))} no torchlens formula ({', '.join(names)}): their "
                     "FLOPs are missing from the torchlens side, not zero"
                     + (f"; FlopCounterMode counted nothing inside {', '.join(neither)} either (no entry in its "
                        "flop registry), so neither side has a figure for that work" if neither else ""))
    if unread:
        notes.append(f"{_ops_have(len(unread))} a torchlens formula that could not count that call "
                     f"({listed(unread, 3)}: an operand read through a view written in place, a nested tensor's "
                     "ragged size, or arguments the formula does not model, such as a negative matrix_power "
                     "exponent): their FLOPs are missing from the torchlens side, not zero")
    if vmapped:
        notes.append(f"{counted(len(vmapped), 'captured op')} ran inside torch.vmap ({listed(vmapped, 3)}), where "
                     "capture records one example's shapes while the kernels ran on the whole batch: their FLOPs are "
                     "missing from the torchlens side, not zero")
    return notes


def script_notes(log) -> list:
    """A TorchScript module runs its ops in TorchScript's interpreter, out of capture's sight, so the trace holds
    none of them and its row reads 0 on the torchlens side, with no op left unknown to say so; FlopCounterMode,
    which counts at the ATen level below it, counts them."""
    outermost = list(script_modules(log))
    if not outermost:
        return []
    return [f"TorchScript modules ({', '.join(outermost)}) ran their ops where torchlens's capture cannot see them: "
            "their FLOPs are missing from the torchlens side, not zero, where FlopCounterMode, which counts below "
            "TorchScript, counted those in its registry; trace the modules as they were before torch.jit.script or "
            "torch.jit.trace to compare them"]


def _ops_have(n: int) -> str:
    return f"{counted(n, 'captured op')} {'has' if n == 1 else 'have'}"


def randomness_advice(model) -> str:
    """What to do about a forward that draws: eval mode, unless every module it runs is in eval mode already, where
    that advice would change nothing (the forward samples by itself: ViLT's multinomial patch sampling)."""
    from ..capture.restore import module_run_by

    module = module_run_by(model)
    if module is None or any(m.training for m in module.modules()):
        return "Call model.eval() (or remove the randomness) and compare again."
    return ("The model is in eval mode already, so its forward draws them by itself (sampling, not dropout): "
            "remove the randomness, or compare a part of the model that draws none.")


def drawn_by(log, generators) -> str:
    """What drew: the captured ops that draw (up to five), else the generators that moved.  A dropout in eval mode
    or with ``p=0`` draws nothing, so it is no suspect: naming it would hide a draw capture cannot see (NumPy's,
    as wav2vec2-style time masks make)."""
    randoms = [op.label for op in log.ops
               if op.kind == "op" and _is_random(op.func_name.partition(".")[0]) and _draws(log, op)]
    if randoms:
        return listed(randoms, 5)
    return f"{' and '.join(generators)} moved, outside any captured op's draw"


def _draws(log, op) -> bool:
    """Whether an op torch tags as drawing random numbers did: a dropout only when it drops anything, attention
    only with a ``dropout_p`` above 0 (transformers passes 0.0 in eval mode and when its dropout is 0)."""
    name = canonical_name(op.func_name)
    if "dropout" in name:
        return dropout_applies(CallArgs(log, log.call_indices[op.index], op.shape))
    if name == "scaled_dot_product_attention":
        return bool(CallArgs(log, log.call_indices[op.index], op.shape).value(4, "dropout_p", 0.0))
    return True


@functools.lru_cache(maxsize=None)
def _is_random(func_name: str) -> bool:
    """Whether torch tags an aten op of this name as drawing random numbers (used to name suspects;
    that the forward drew at all is decided by the generator state, ``RngState.moved``).  Looked up by name:
    ``dir(torch.ops.aten)`` lists only the ops loaded so far in the process, so a set built from it answered
    differently depending on what had run before."""
    try:
        packet = getattr(torch.ops.aten, func_name)
    except (AttributeError, RuntimeError):  # no aten op of that name (__getitem__, a user's function)
        return False
    overloads = getattr(packet, "overloads", None)
    return overloads is not None and any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags
                                         for o in overloads())
