"""Pass grouping: which executions of ops are passes of one layer (recurrence).

Rules, applied in one pass over the ops in execution order (linear time):

1. An op run inside a module object that was called more than once is keyed by that module object,
   its call site, its function, its output slot and how many times that site had already called that
   function within the module call: every call of a shared module contributes one pass to each of its
   op sites, also when its calls take different branches or run a loop a different number of times
   (a position within the call would pair ops of different lines once the calls diverge).
2. An op that uses parameters is keyed by its function, the parameter objects, its output slot, its
   module object and its non-tensor arguments: the same weights applied again (a Python loop over
   ``x @ self.W``) are passes of one layer; distinct modules never merge, even with tied weights.
3. Any other op is keyed by its call site (the calling frame's code object and instruction offset, with
   those of the user lines that called its function, and the user frame's too when the calling frame is
   torch's own code), function, output slot, non-tensor
   arguments, input shapes and module object: the same line run again by a Python loop is another pass.
   A class whose every later member consumes an earlier member (``x = x + 1`` in a loop: a single-op
   self-chain) is not recurrence and is split back into separate layers, unless the chain also feeds or
   is fed by another repeated layer: then it is one step of a longer loop body
   (``while x.mean() > 0: x = x * 2``: ``mean``, ``gt`` and ``mul`` are all layers with one pass per
   iteration).

Whether the repeated layers came from a loop or from a module reused at several call sites is told
apart afterwards, for display only (``repetition``).
"""

from __future__ import annotations

import dis
import math
from collections import Counter
from operator import itemgetter
from types import CodeType

import torch

from ..cache import per_object

_PRECALL = dis.opmap.get("PRECALL")  # Python 3.11's; later versions have none
_JUMPS = frozenset(dis.hasjrel + dis.hasjabs)  # whose argument, a target, differs between copies of one code


def arg_signature(obj, depth: int = 0):
    """A hashable, address-free summary of non-tensor arguments."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return "nan" if math.isnan(obj) else obj
    if isinstance(obj, (torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)):
        return obj
    if isinstance(obj, slice):
        return ("slice", arg_signature(obj.start), arg_signature(obj.stop), arg_signature(obj.step))
    if obj is Ellipsis:
        return "..."
    if depth < 6:
        if isinstance(obj, (tuple, list)):
            return tuple(arg_signature(o, depth + 1) for o in obj)
        if isinstance(obj, dict):
            return tuple(sorted((str(k), arg_signature(v, depth + 1)) for k, v in obj.items()))
    return type(obj).__name__


# Fields of a raw call tuple read here: the ``record.columns.Call`` layout, named here because labels
# sits below record (tests/test_columns.py checks they agree).
CALL_FUNC, CALL_ARGS, CALL_KWARGS, CALL_PARAMS, CALL_CODE, CALL_LINE, CALL_SITE = 0, 1, 2, 4, 6, 7, 13
META_SHAPE = 0  # ``record.columns.OpMeta.shape``
_SHAPE = itemgetter(META_SHAPE)
_SECOND = itemgetter(1)  # of a (position, parent) or (position, Parameter) pair


def args_key(call) -> tuple:
    """The non-tensor arguments of a raw call as a hashable key (fast when they are hashable)."""
    args, kwargs = call[CALL_ARGS], call[CALL_KWARGS]
    key = (args, tuple(kwargs.items()) if kwargs else None)
    try:
        hash(key)
    except TypeError:  # lists, dicts, slices (before Python 3.12), unhashable objects
        return (arg_signature(args), arg_signature(kwargs))
    return key


def group_ops(call_col, slot_col, module_col, parents_col, meta, calls, module_objects, module_counts,
              recursed_root=None):
    """Return a group id per node (nodes with ``call_col[i] < 0`` are sources and outputs).  ``recursed_root``:
    the traced root module when it called itself, so that the ops of its first call (the trace, outside every
    module call) are grouped with those of its later calls, as a shared module's are (rule 1)."""
    group: list = [-1] * len(call_col)
    keys: dict = {}
    seen_in_call: dict = {}  # (module call, site, func) -> how many times it ran before, in that call
    site_ops = []
    # Each op's output shape: a parent of unknown origin (-1) reads the None at the end.
    shapes = list(map(_SHAPE, meta))
    shapes.append(None)
    for i, c in enumerate(call_col):
        if c < 0:
            group[i] = keys.setdefault(("source", i), len(keys))
            continue
        slot, module_call = slot_col[i], module_col[i]
        call = calls[c]
        func = call[CALL_FUNC]
        module = None
        if module_call >= 0:
            module = module_objects[module_call]
            if module_counts[id(module)] > 1:
                group[i] = keys.setdefault(_shared_module_key(call, func, slot, module_call, module, seen_in_call),
                                           len(keys))
                continue
        elif recursed_root is not None:  # in the root's call 1, which its later calls repeat
            group[i] = keys.setdefault(_shared_module_key(call, func, slot, -1, recursed_root, seen_in_call),
                                       len(keys))
            continue
        # The non-tensor arguments as they are (hashed once, by the dict), or by signature when unhashable.
        kwargs, params = call[CALL_KWARGS], call[CALL_PARAMS]
        arguments = (call[CALL_ARGS], tuple(kwargs.items()) if kwargs else None)
        if params:
            ids = tuple(sorted(map(id, map(_SECOND, params))))
            try:
                group[i] = keys.setdefault(("params", func, ids, slot, id(module), arguments), len(keys))
            except TypeError:  # lists, dicts, slices (before Python 3.12), unhashable objects
                group[i] = keys.setdefault(("params", func, ids, slot, id(module), args_key(call)), len(keys))
        else:
            parents = parents_col[i]
            if len(parents) == 1:  # the common case, without a loop
                input_shapes = (shapes[parents[0][1]],)
            else:
                input_shapes = tuple([shapes[p] for _, p in parents])
            site = _reached_site(call)
            try:
                group[i] = keys.setdefault(("site", site, func, slot, arguments, input_shapes, id(module)), len(keys))
            except TypeError:
                group[i] = keys.setdefault(("site", site, func, slot, args_key(call), input_shapes, id(module)),
                                           len(keys))
            site_ops.append(i)

    _split_self_chains(group, site_ops, parents_col, len(keys))
    return group


def _site_of(call):
    """The call site of a raw call as a hashable key: its code object by id (hashing a code object hashes
    its bytecode) and instruction offset, and those of the user lines that called it, or None when no
    frame was found."""
    site = call[CALL_SITE]
    return _site_key(site) if site is not None else None


def _site_key(site) -> tuple:
    """``site`` (``(code, offset)``, or ``(code, offset, caller's site)`` for a function called by user
    code: ``capture/source.py``'s ``user_site``) with each code object by id."""
    if len(site) == 2:
        return (id(site[0]), call_offset(site[0], site[1]))
    return (id(site[0]), call_offset(site[0], site[1]), _site_key(site[2]))


def call_offset(code, offset):
    """The offset that names, for grouping, the instruction a frame at ``offset`` of ``code`` is running.

    Python 3.11's specializing interpreter runs a warm call of a builtin (``operator.mul``, ``sum``,
    ``functools.reduce``) inside its ``PRECALL`` instruction, while a cold one runs in the ``CALL`` after
    it: the frame names one call site by two offsets, and a loop through such a call would split into
    two layers once the site warms up.  Both are read as the ``CALL``'s.  And the compiler copies some
    code: a ``while`` loop's test is compiled before the loop and again at the end of its body, so its
    first run and its later ones run at two offsets of one expression.  A copy is read as its original's
    offset (``_copied_offsets``).  On Python 3.12 a frame suspended in an instruction that runs a generator
    inline (a warm ``for`` over a generator, ``FOR_ITER_GEN``) names an offset inside that instruction's inline
    cache, where the cold instruction names its own: an offset inside an instruction's cache is read as the
    instruction's."""
    if type(code) is not CodeType:  # (a trace read by tl.load holds stand-ins for code)
        return offset
    return _canonical_offsets(code).get(offset, offset)


@per_object
def _canonical_offsets(code) -> dict:
    """``{offset: the offset call_offset reads it as}`` in ``code``, for the offsets read otherwise."""
    instructions = list(dis.get_instructions(code))
    canonical = _copied_offsets(instructions)
    pending = None
    for instruction in instructions:
        if instruction.opcode == _PRECALL:
            pending = instruction.offset
        elif instruction.opname == "CALL" and pending is not None:
            canonical[pending] = canonical.get(instruction.offset, instruction.offset)
            pending = None
    canonical.update(_exception_exits(instructions, canonical))
    for instruction, after in zip(instructions, instructions[1:]):
        for cache in range(instruction.offset + 2, after.offset, 2):  # its inline cache entries
            canonical[cache] = canonical.get(instruction.offset, instruction.offset)
    return canonical


def _copied_offsets(instructions: list) -> dict:
    """``{offset of a copy: offset of the original}``: an instruction is a copy of an earlier one when the
    instructions of its line up to it (names, arguments and source spans) are those of the earlier one's.
    Comparing only its own span would merge the two comparisons of ``a < b < c``, which share one span."""
    prefixes: dict = {}  # (prefix id, instruction) -> id of the prefix it ends
    first_of: dict = {}  # prefix id -> the offset of the first instruction that ended it
    copied = {}
    prefix, line, previous = -1, None, None
    for instruction in instructions:
        if instruction.opname.startswith("LOAD_FAST"):
            # A local's load is the same in a copy as in its original, and Python 3.13 fuses the copy's into the
            # body's last store (STORE_FAST_LOAD_FAST, with the store's span): read only what the loads feed.
            continue
        span = instruction.positions
        if span is None or span.lineno is None:
            # The compiler's own code (the cleanup of a with item's exception handler on 3.11) is no place in the
            # source: read through it, or what follows would start its line again there, and the exits of
            # ``with a, b, c:`` after the first would read as copies of one another.
            continue
        if None in span:  # no columns (python -X no_debug_ranges): one line is no place
            prefix, line = -1, None
            continue
        if span.lineno != line or _wholly_before(span, previous):
            # A new line, or code of this line before what ran last (``while x.sum() > 0: x = x - 1``
            # tests again after its body): the copy starts here as its original starts a line.
            prefix, line = -1, span.lineno
        previous = span
        argument = None if instruction.opcode in _JUMPS else instruction.argrepr
        prefix = prefixes.setdefault((prefix, instruction.opname, argument, *span), len(prefixes))
        first = first_of.setdefault(prefix, instruction.offset)
        if first != instruction.offset:
            copied[instruction.offset] = first
    return copied


def _exception_exits(instructions: list, canonical: dict) -> dict:
    """``{offset of a WITH_EXCEPT_START: offset of the normal exit's __exit__ call of its with item}``.

    A with block left by an exception calls ``__exit__`` at ``WITH_EXCEPT_START``, the same place in the source
    as the normal exit's call (``CALL 2`` of three ``None``), which has the same span.  The items of one
    statement (``with a(), b():``) share that span on Python 3.11 and 3.12 (3.13 gives each item its own): their
    normal exits are compiled innermost first, and so are their handlers, each after its exit on 3.11 but all
    after the last exit on 3.12, so the k-th handler of a span is the k-th item's whichever way they interleave.
    A copy of an exit (a return or break leaving the block) is one exit with its original; a copy of the whole
    statement (in a finally block) repeats the items' order."""
    exits: dict = {}  # span -> the canonical offsets of its normal exits' calls, in order, each once
    handlers: dict = {}  # span -> the offsets of its WITH_EXCEPT_STARTs, in order
    nones = 0  # consecutive loads of None just before (3.11's PRECALL between them and the CALL)
    for instruction in instructions:
        if instruction.opname == "CALL" and instruction.arg == 2 and nones >= 3:
            offsets = exits.setdefault(instruction.positions, [])
            original = canonical.get(instruction.offset, instruction.offset)
            if original not in offsets:
                offsets.append(original)
        elif instruction.opname == "WITH_EXCEPT_START":
            handlers.setdefault(instruction.positions, []).append(instruction.offset)
        if instruction.opcode != _PRECALL:
            loads_none = instruction.opname == "LOAD_CONST" and instruction.argval is None
            nones = nones + 1 if loads_none else 0
    return {offset: exits[span][k % len(exits[span])] for span, offsets in handlers.items() if span in exits
            for k, offset in enumerate(offsets)}


def _wholly_before(span, previous) -> bool:
    """Whether the source of ``span`` ends before that of ``previous`` begins."""
    return previous is not None and (span.end_lineno, span.end_col_offset) <= (previous.lineno, previous.col_offset)


def _reached_site(call):
    """Rule 3's site: the call site and, when that is a line of torch's own Python code (a ``torch.empty``
    inside ``nn.Linear.__init__``, run by the forward), the user lines that reached it too.  The same torch
    line reached from two user lines is two layers; from one user line run again, two passes."""
    site = call[CALL_SITE]
    if site is None:
        return None
    code, offset = call[CALL_CODE], call[CALL_LINE]
    if code is None or len(site) == 3 or (site[0] is code and site[1] == offset):
        return _site_key(site)  # the user lines are in the site: its own, or those that reached torch's line
    return (id(site[0]), call_offset(site[0], site[1]), id(code), call_offset(code, offset))


def _shared_module_key(call, func, slot, module_call, module, seen_in_call) -> tuple:
    """Rule 1's key: the module object, the op's site and function, its output slot, and the occurrence of
    that site and function within this module call (counted once per call, at its first output)."""
    site = _site_of(call)
    counted = (module_call, site, func)
    if slot is None or slot == 0 or slot == (0,):
        seen_in_call[counted] = seen_in_call.get(counted, -1) + 1
    return ("module", id(module), site, func, slot, seen_in_call.get(counted, 0))


def _split_self_chains(group: list, site_ops: list, parents_col: list, next_id: int) -> None:
    """Rule 3's exception: a class fed only by itself is a chain, not a loop body.

    A later member that also consumes another repeated layer (a residual ``x = x + block(x)``, an RNN
    ``h = tanh(fc(x) + h)``) is part of a loop body; one fed only by its own class and by one-off
    tensors (``x = x + 1``, ``x = x * y``) is a chain.
    """
    site_groups = [group[i] for i in site_ops]
    if len(set(site_groups)) == len(site_groups):
        return  # no call site ran twice: nothing to split
    sizes = Counter(group)
    members: dict = {}
    for i, gid in zip(site_ops, site_groups):
        members.setdefault(gid, []).append(i)

    def fed_by_other_loop(i, gid):
        return any(p >= 0 and group[p] != gid and sizes[group[p]] > 1 for _, p in parents_col[i])

    chains = [(gid, ops) for gid, ops in members.items() if len(ops) > 1 and
              all(any(p >= 0 and group[p] == gid for _, p in parents_col[i]) for i in ops[1:])]
    if not chains:
        return
    in_chain = {i for _, ops in chains for i in ops}
    feeds: dict = {}  # chain member -> the repeated groups (other than its own) that read it
    for j, parents in enumerate(parents_col):
        for _, p in parents:
            if p in in_chain and group[j] != group[p] and sizes[group[j]] > 1:
                feeds.setdefault(p, set()).add(group[j])
    for gid, ops in chains:
        if any(fed_by_other_loop(i, gid) for i in ops[1:]) or any(i in feeds for i in ops[:-1]):
            continue  # one step of a longer loop body
        for i in ops[1:]:
            group[i] = next_id
            next_id += 1


def repetition(trace):
    """``"loop"`` when some layer's passes re-ran the same code (a loop, ``generate`` steps),
    ``"reused"`` when every repeated layer ran from different call sites (a shared module called
    from several lines), None when nothing repeated.  A loaded trace answers with the verdict its live
    trace gave (saved with it: it holds no module call frames); one saved before the verdict was, with the
    ops' own lines only."""
    if not trace.is_recurrent:
        return None
    if trace._saved_repetition is not None:
        return trace._saved_repetition
    frames = trace._module_call_frames
    seen: dict = {}
    calls, groups, group_sizes = trace.calls, trace.groups, trace.group_sizes
    module_call_indices = trace.module_call_indices
    for i, c in enumerate(trace.call_indices):
        if c < 0 or group_sizes[groups[i]] < 2:
            continue
        call = calls[c]
        origin = [id(call.code), call_offset(call.code, call.line)]
        m = module_call_indices[i] if frames is not None else -1
        while m >= 0:  # the lines that made each enclosing module call
            code, offset = frames[m]
            origin += (id(code), call_offset(code, offset))
            parent = trace.module_calls[m].parent
            m = parent.index if parent is not None else -1
        origins = seen.setdefault(groups[i], set())
        key = tuple(origin)
        if key in origins:
            return "loop"
        origins.add(key)
    return "reused"
