"""``compare``: the first op, in execution order, where ranks that should agree (DDP replicas) diverge.

Each rank is compared with a reference rank op by op: first the graph (same label at the same
position, reading the same ops), then shape and dtype, then the saved activations, bit for bit or within
``rtol`` / ``atol``.
The first op that differs is where the drift shows; ``origin`` is ``"here"`` when every parent of that op
was compared and agreed (the drift starts at this op: a parameter or a buffer that differs, a
nondeterministic kernel), and ``"unknown"`` when a parent's activation was not saved on both ranks.
The values of ops that return uninitialized memory (``torch.empty`` and kin) are never compared: they
hold whatever the allocator left there, which differs between ranks that agree.
"""

from __future__ import annotations

from ..errors import counted, refusing_unknown_keywords
from ..checks import check_int, check_number, is_a
from ..record.trace import Trace, checked_trace
from ..tree import structures_equal
from ..record.columns import UNINITIALIZED_FUNCS
from ..record.tables import require_pandas
from .gather import RankTrace

COLUMNS = ["rank", "reference", "diverges", "first_op", "module", "func", "reason", "max_abs_diff", "origin",
           "ops_compared"]


@refusing_unknown_keywords("tl.distributed.compare")
def compare(traces, *, rtol: float = 0.0, atol: float = 0.0, reference: int = 0):
    """A pandas table with one row per rank other than ``reference``: where it first diverges, and why.

    Args:
        traces: one trace per rank, in any order (each row names the rank its trace recorded): ``Trace`` objects
            (a rank's own, or ``tl.load``'ed per-rank saves) or the ``RankTrace`` list ``gather`` returns.
        rtol, atol: tolerances; both 0 (the default) compares bit for bit (NaN equals NaN).
        reference: the position in ``traces`` of the trace the others are compared with.  The table's
            ``rank`` and ``reference`` columns give the ranks the traces recorded (positions for traces made
            outside a process group).
    """
    if traces is None:  # what gather returns on the ranks other than dst
        raise TypeError("compare got None, which tl.distributed.gather returns on every rank but dst: call compare on "
                        "dst alone (if rank == dst: compare(traces))")
    if isinstance(traces, Trace):  # iterating it would give its ops
        raise TypeError("compare takes one trace per rank, in rank order ([log_rank0, log_rank1] or what gather "
                        "returns), got a single Trace")
    if not isinstance(traces, (list, tuple)):  # compare(3) failed in the loop below: "'int' object is not iterable"
        raise TypeError(f"compare: traces={traces!r} {is_a(traces)}; give one trace per rank, in rank order "
                        "([log_rank0, log_rank1] or what gather returns)")
    # A NaN or negative tolerance fails inside torch.allclose, a string too; reference=True is no rank.
    for name, value in (("rtol", rtol), ("atol", atol)):
        check_number(value, name, "a tolerance is a number, 0 or more (0 compares bit for bit)", who="compare",
                     at_least=0)
    check_int(reference, "reference", "give the position in traces of the trace the others are compared with",
              who="compare", at_least=0)
    ranks = [t if isinstance(t, RankTrace) else
             RankTrace.of(checked_trace(t, f"compare: traces[{i}]", "a rank's tl.trace, or tl.load of its save"),
                          activations=True) for i, t in enumerate(traces)]
    if not 0 <= reference < len(ranks):
        raise ValueError(f"compare: reference={reference} is no position in traces, which holds {len(ranks)} (0 to "
                         f"{len(ranks) - 1}); reference is the position of the trace the others are compared with, "
                         "not its rank")
    base = ranks[reference]
    rows = [_first_divergence(base, other, reference, r, rtol, atol)
            for r, other in enumerate(ranks) if r != reference]
    return require_pandas("a torchlens.distributed table").DataFrame(rows, columns=COLUMNS)


def _first_divergence(base, other, reference, rank, rtol, atol) -> dict:
    # Ranks as the traces recorded them (a subgroup's, or saves listed in any order); positions otherwise.
    row = {"rank": other.rank if other.rank is not None else rank,
           "reference": base.rank if base.rank is not None else reference, "diverges": False,
           "first_op": None, "module": None, "func": None, "reason": None, "max_abs_diff": None, "origin": None,
           "ops_compared": 0}
    uncompared: set = set()  # ops whose activations were not saved on both ranks
    for i in range(max(len(base.ops), len(other.ops))):
        a = base.ops[i] if i < len(base.ops) else None
        b = other.ops[i] if i < len(other.ops) else None
        reason, diff = _op_difference(a, b, base, other, rtol, atol)
        if reason is None:
            if _values_comparable(a, base) and _values_comparable(b, other):
                row["ops_compared"] += 1
            else:
                uncompared.add(a["label"])
            continue
        op = a or b
        row.update(diverges=True, first_op=op["label"], module=op["module"], func=op["func"], reason=reason,
                   max_abs_diff=diff, origin="unknown" if uncompared & set(op["parents"]) else "here")
        return row
    row["reason"] = _agreement_reason(len(uncompared), row["ops_compared"])
    return row


def _agreement_reason(uncompared: int, compared: int):
    """What an agreement covers when some values could not be compared (None when every value was)."""
    if not uncompared:
        return None
    if not compared:
        return ("no values compared: the graph, shapes and dtypes agree, but no activation was saved on both "
                "ranks (gather with activations=True, from traces that saved them)")
    return (f"the graph, shapes and dtypes agree; {counted(compared, 'op')} agree by value and {uncompared} "
            f"{'was' if uncompared == 1 else 'were'} not compared (not saved on both ranks, or uninitialized memory)")


def _op_difference(a, b, base, other, rtol, atol):
    """``(reason, max |a - b|)`` when op ``a`` (reference) and ``b`` differ, ``(None, None)`` otherwise."""
    if a is None or b is None:
        present = a or b
        return f"the graph ends earlier on one rank ({present['label']} has no counterpart)", None
    if a["label"] != b["label"]:
        return f"the graph differs: {a['label']} on the reference, {b['label']} here", None
    if a["parents"] != b["parents"]:
        return (f"the graph differs: {a['label']} reads {', '.join(a['parents']) or 'no op'} on the reference, "
                f"{', '.join(b['parents']) or 'no op'} here"), None
    if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
        return f"{a['shape']} {a['dtype']} on the reference, {b['shape']} {b['dtype']} here", None
    if not (_values_comparable(a, base) and _values_comparable(b, other)):
        return None, None  # not saved on one side, or uninitialized memory: nothing to compare
    x, y = base.activations[a["label"]], other.activations[b["label"]]
    equal, _ = structures_equal(x, y, exact=rtol == 0 and atol == 0, rtol=rtol, atol=atol)
    if equal:
        return None, None
    diff = _largest_difference(x, y) if x.is_floating_point() or x.is_complex() else None
    return "values differ" if rtol == 0 and atol == 0 else f"values differ beyond rtol={rtol}, atol={atol}", diff


def _largest_difference(x, y) -> float:
    """``max |x - y|`` over the elements that differ: an infinity or a NaN both ranks hold agrees (``inf - inf`` is
    NaN, which read as a difference hid the real one behind ``inf``), and one against anything else is the largest
    difference there is (``inf``)."""
    if not x.numel():
        return 0.0
    agree = (x == y) | (x.isnan() & y.isnan())
    return float((x - y).abs().double().nan_to_num(nan=float("inf")).masked_fill(agree, 0.0).max())


def _values_comparable(op, trace) -> bool:
    """Whether ``op``'s saved value can be compared: it was saved, and it is not uninitialized memory
    (``torch.empty`` and kin, or a view of one, hold whatever the allocator left there, different on ranks that
    agree: ``RankTrace.of`` marks them)."""
    return op["label"] in trace.activations and not op.get("uninitialized", op["func"] in UNINITIALIZED_FUNCS)
