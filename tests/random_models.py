"""Random models for property tests: real Python source, generated, compiled and run.

A model is drawn as plain data (a ``Program``: blocks of steps), then rendered to the source text of
``nn.Module`` classes, so that every step has its own line, loops are real ``for`` loops and submodules
are real attributes: capture sees exactly what it would see in a hand-written model.  Every value has
shape (2, 8), so any step can consume any earlier value.  Nothing random happens inside forward.
"""

from __future__ import annotations

import itertools
import linecache
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

# One-value steps: ``{a}``, ``{b}`` are earlier values, ``{o}`` the new one; ``{t}`` a fresh temporary.
UNARY = ["{o} = torch.tanh({a})", "{o} = F.relu({a})", "{o} = {a}.sigmoid()", "{o} = -{a}",
         "{o} = torch.sin({a}) * 0.5", "{o} = {a}.abs() + 0.25"]
BINARY = ["{o} = {a} + {b}", "{o} = {a} * {b}", "{o} = torch.maximum({a}, {b})", "{o} = {a} - 0.5 * {b}",
          "{o} = torch.where({a} > {b}, {a}, {b})"]
MATMUL = ["{o} = torch.matmul({a}, {b}.t()) @ {a} * 0.1", "{o} = ({a} @ self.{P}).tanh()",
          "{o} = torch.bmm({a}.unsqueeze(0), self.{P}.unsqueeze(0)).squeeze(0)"]
CONV = ["{o} = self.{C}({a}.unsqueeze(1)).squeeze(1)",
        "{o} = F.conv1d({a}.reshape(2, 1, 8), self.{K}, padding=1).view(2, 8)"]
REDUCE = ["{o} = {a} - {a}.mean(dim=-1, keepdim=True)", "{o} = {a} * {a}.sum(0, keepdim=True).tanh()",
          "{o} = F.softmax({a}, dim=-1)", "{o} = {a} / ({a}.norm(dim=1, keepdim=True) + 1)",
          "{o} = {a}.amax(1, keepdim=True).expand(2, 8) + {a}",
          "{o} = torch.logsumexp({a}, 1, keepdim=True) * {a}"]
VIEW = ["{o} = {a}.reshape(4, 4).t().reshape(2, 8)", "{o} = {a}.transpose(0, 1).contiguous().transpose(0, 1)",
        "{o} = {a}.unsqueeze(0).flatten(0, 1)", "{o} = {a}.reshape(16).flip(0).view(2, 8)",
        "{o} = {a}.permute(1, 0).T"]
INDEX = ["{o} = torch.cat([{a}[:, 4:], {a}[:, :4]], dim=1)", "{o} = {a}[[1, 0]]",
         "{o} = {a}.index_select(1, torch.arange(7, -1, -1))", "{o} = {a}[:, None, :].squeeze(1)",
         "{o} = {a}.gather(1, torch.argsort({a}, dim=1))", "{o} = {a}[{b} > 0].sum() + {a}"]
INPLACE = ["{o} = {a}.clone(); {o}.mul_(0.5)", "{o} = {a}.clone(); {o}[:, 0] = 1.0",
           "{o} = {a}.clone(); {o}[:, :4].add_({b}[:, 4:])", "{o} = F.relu({a}.clone(), inplace=True)",
           "{o} = {a}.clone().clamp_(-0.5, 0.5)", "{a}.mul_(0.75); {o} = {a}", "{a} += {b}; {o} = {a} * 1.0"]
MULTI = ["{t}a, {t}b = torch.chunk({a}, 2, dim=1); {o} = torch.cat([{t}b, {t}a * 2], dim=1)",
         "{t}v, {t}i = {a}.max(dim=1, keepdim=True); {o} = {a} - {t}v + {t}i.float()",
         "{t}s, {t}i = torch.sort({a}, dim=1); {o} = {t}s * 0.5 + {a}",
         "{o} = torch.stack(torch.unbind({a}, dim=0)[::-1])",
         "{t} = torch.split({a}, [3, 5], dim=1); {o} = torch.cat([{t}[1], {t}[0]], dim=1)",
         "{t}lo, {t}hi = torch.aminmax({a}, dim=1, keepdim=True); {o} = ({a} - {t}lo) / ({t}hi - {t}lo + 1)"]
CONCAT = ["{o} = torch.cat([{a}, {b}], dim=0)[1:3]", "{o} = torch.stack([{a}, {b}]).mean(0)"]
MODULE = ["{o} = self.{L}({a})", "{o} = self.{S}({a})"]
# Loop bodies: ``{o}`` is the loop-carried value.
LOOP = ["{o} = torch.tanh(self.{L}({o}) + {b})", "{o} = {o} * 0.9 + {b} * 0.1", "{o} = torch.tanh({o})",
        "{o} = self.{B}({o})"]

# Injected faults, emitted as ``if self.inject: <line>`` before the chosen step of the chosen body.
FAULTS = {"torch error": "{o}_ = torch.ones(3) + {a}", "ValueError": "raise ValueError('injected fault')",
          "KeyboardInterrupt": "raise KeyboardInterrupt('injected interrupt')",
          "MemoryError": "raise MemoryError('injected out of memory')",
          "failed allocation": "{o}_ = torch.empty(1 << 60)"}

FAMILIES = {"unary": UNARY, "binary": BINARY, "matmul": MATMUL, "conv": CONV, "reduce": REDUCE,
            "view": VIEW, "index": INDEX, "inplace": INPLACE, "multi": MULTI, "concat": CONCAT,
            "module": MODULE}


@dataclass
class Step:
    family: str  # a key of FAMILIES, "block" (call a generated block) or "loop"
    variant: int
    a: int  # earlier values, as indices into the values defined so far (taken modulo their count)
    b: int
    block: int = 0  # for "block" and block-calling loops: which block
    repeats: int = 2  # for "loop"


@dataclass
class Program:
    blocks: list  # list of list[Step]; block i may call only blocks j > i (bounded nesting)
    root: list
    alias_block: bool = False  # register block 0 under a second attribute name as well
    two_outputs: bool = False
    seed: int = 0
    fault: tuple | None = None  # (body: -1 root or a block index, step position, key of FAULTS)
    source: str = field(default="", repr=False)


_families = sorted(FAMILIES) + ["block", "loop"]


@st.composite
def steps(draw, n_blocks_after: int, min_steps: int, max_steps: int):
    out = []
    for _ in range(draw(st.integers(min_steps, max_steps))):
        family = draw(st.sampled_from(_families if n_blocks_after else _families[:-2] + ["loop"]))
        variants = len(FAMILIES[family]) if family in FAMILIES else len(LOOP)
        variant = draw(st.integers(0, variants - 1))
        if family == "loop" and variant == 3 and not n_blocks_after:
            variant = 0  # a loop over a block needs a block to call
        out.append(Step(family, variant, draw(st.integers(0, 50)), draw(st.integers(0, 50)),
                        draw(st.integers(0, max(n_blocks_after - 1, 0))), draw(st.integers(2, 3))))
    return out


@st.composite
def programs(draw, max_blocks: int = 3, max_steps: int = 10):
    n_blocks = draw(st.integers(0, max_blocks))
    blocks = [draw(steps(n_blocks - i - 1, 1, 4)) for i in range(n_blocks)]
    root = draw(steps(n_blocks, 3, max_steps))
    return Program(blocks, root, alias_block=n_blocks > 0 and draw(st.booleans()),
                   two_outputs=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


# ----- rendering ---------------------------------------------------------------------------------
_counter = itertools.count()


def _render_body(steps_, offset: int, owned: dict, fault=None) -> list:
    """Source lines of one forward body; ``owned`` collects the submodules/parameters it needs;
    ``fault`` is ``(position, key of FAULTS)`` to inject before that step (or at the end)."""
    lines = ["    def forward(self, x):", "        v0 = x"]
    n = 1
    for k, s in enumerate(steps_ + [None]):
        if fault is not None and min(fault[0], len(steps_)) == k:
            owned["inject"] = "flag"
            lines.append("        if self.inject:")
            lines.append("            " + FAULTS[fault[1]].format(o=f"v{n}", a=f"v{n - 1}"))
        if s is None:
            break
        a, b, o, t = f"v{s.a % n}", f"v{s.b % n}", f"v{n}", f"t{k}"
        names = {"a": a, "b": b, "o": o, "t": t, "P": f"p{k}", "K": f"k{k}", "C": f"conv{k}",
                 "L": f"fc{k}", "S": f"seq{k}", "B": f"block{offset + s.block}"}
        if s.family == "loop":
            template = LOOP[s.variant]
            lines.append(f"        {o} = {a}")
            lines.append(f"        for _ in range({s.repeats}):")
            lines.append("            " + template.format(**names))
        elif s.family == "block":
            template = "{o} = self.{B}({a})"
            lines.append("        " + template.format(**names))
        else:
            template = FAMILIES[s.family][s.variant]
            lines.append("        " + template.format(**names))
        for key, kind in (("P", "param"), ("K", "kernel"), ("C", "conv"), ("L", "linear"), ("S", "seq"),
                          ("B", "block")):
            if "{" + key + "}" in template:
                owned[names[key]] = kind
        n += 1
    return lines, n


def render(program: Program) -> str:
    """The program as module source: ``Block{i}`` classes and a ``Model`` class."""
    out = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F", ""]
    owned_by = {}
    bodies = {}
    fault = program.fault
    for i, body in enumerate(program.blocks):
        owned_by[f"Block{i}"] = owned = {}
        here = fault[1:] if fault is not None and fault[0] == i else None
        bodies[f"Block{i}"] = _render_body(body, i + 1, owned, here)
    owned_by["Model"] = owned = {}
    here = fault[1:] if fault is not None and fault[0] == -1 else None
    bodies["Model"] = _render_body(program.root, 0, owned, here)
    for cls, (lines, n) in bodies.items():
        out.append(f"class {cls}(nn.Module):")
        out.append("    def __init__(self, blocks):")
        out.append("        super().__init__()")
        for name, kind in owned_by[cls].items():
            out.append(f"        self.{name} = {_constructor(kind, name)}")
        if cls == "Model" and program.alias_block and program.blocks:
            out.append("        self.block0_alias = blocks[0]")
        out.extend(lines)
        last = f"v{n - 1}"
        if cls == "Model" and program.two_outputs:
            out.append(f"        return {last}, v{max(n - 2, 0)}.sum(dim=1)")
        else:
            out.append(f"        return {last}")
        out.append("")
    return "\n".join(out)


def _constructor(kind: str, name: str) -> str:
    return {
        "param": "nn.Parameter(torch.randn(8, 8) * 0.3)",
        "kernel": "nn.Parameter(torch.randn(1, 1, 3) * 0.5)",
        "conv": "nn.Conv1d(1, 1, 3, padding=1)",
        "linear": "nn.Linear(8, 8)",
        "seq": "nn.Sequential(nn.Linear(8, 8), nn.Tanh())",
        "block": f"blocks[{name[len('block'):]}]",
        "flag": "True",
    }[kind]


def build(program: Program):
    """``(model, x)``: a fresh model (weights from ``program.seed``) and its input."""
    source = program.source or render(program)
    program.source = source
    filename = f"<random model {next(_counter)}>"
    # Register the text so that SourceLocation.code and tracebacks can show generated lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    torch.manual_seed(program.seed)
    blocks: list = []
    for i in reversed(range(len(program.blocks))):
        blocks.insert(0, namespace[f"Block{i}"]([None] * (i + 1) + blocks))
    model = namespace["Model"](blocks)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(program.seed))
    return model, x


__all__ = ["Program", "Step", "programs", "render", "build", "FAMILIES", "F", "nn"]
