"""Notes ``flops_vs_dispatch`` adds for work one side of the comparison could not count: ops torchlens left
unknown (no formula, a formula that could not count the call, ops inside ``torch.vmap``) and TorchScript modules,
whose ops capture never sees."""

from __future__ import annotations

from ..errors import counted, listed
from ..record.columns import per_example_ops
from ..record.modules import script_modules
from .flops import registry_family


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
