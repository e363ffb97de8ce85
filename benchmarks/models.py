"""Benchmark models and arms shared by ``overhead_matrix.py`` and ``trace_overhead.py``.

Each model is built in this file from torch alone (no downloads), with fixed seeds, at two input
shapes: a small one, where per-op interposition cost dominates, and a larger one, where kernels do.
The arms are zero-argument callables returning the model's output, ready for ``measure_overhead``.
This file imports only torch, so a worker running under another virtualenv can import it too.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class MLP(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """A ResNet-like CNN: stem, three stages of two basic blocks, pooled linear head."""

    def __init__(self, widths=(16, 32, 64), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LoopRNN(nn.Module):
    """An Elman-style recurrence written as a Python loop reusing one Linear for 16 steps."""

    def __init__(self, width: int = 64, steps: int = 16):
        super().__init__()
        self.cell = nn.Linear(width, width)
        self.steps = steps

    def forward(self, x):
        h = torch.zeros_like(x)
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h) + x)
        return h


class ElementwiseChain(nn.Module):
    """200 elementwise tensor ops in a row (4 per step): the worst case for per-op cost."""

    def __init__(self, steps: int = 50):
        super().__init__()
        self.steps = steps

    def forward(self, x):
        for _ in range(self.steps):
            x = x * 1.001
            x = x + 0.5
            x = torch.sin(x)
            x = F.relu(x)
        return x


class GPT2Block(nn.Module):
    """Pre-norm GPT-2 block with eager causal attention, written out op by op."""

    def __init__(self, d: int, heads: int, context: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        scores = torch.where(self.bias[:t, :t], scores, torch.finfo(scores.dtype).min)
        attn = torch.matmul(F.softmax(scores, dim=-1), v)
        x = x + self.attn_proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Stack(nn.Module):
    """Token and position embeddings, a stack of GPT-2 blocks, final norm and a tied LM head."""

    def __init__(self, vocab: int = 2048, d: int = 256, heads: int = 4, layers: int = 2, context: int = 128):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(GPT2Block(d, heads, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def _transformer():
    layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)


def _randn(*shape):
    return lambda g: (torch.randn(*shape, generator=g),)


def _tokens(batch, length):
    return lambda g: (torch.randint(0, 2048, (batch, length), generator=g),)


# name -> (description, builder, {shape label: input factory}); the first shape is the small one.
MODELS = {
    "mlp3": ("3-layer MLP, width 64", lambda: MLP(3, 64),
             {"batch 32": _randn(32, 64), "batch 512": _randn(512, 64)}),
    "mlp20": ("20-layer MLP, width 256", lambda: MLP(20, 256),
              {"batch 32": _randn(32, 256), "batch 256": _randn(256, 256)}),
    "resnet": ("ResNet-like CNN, 6 basic blocks", SmallResNet,
               {"1x3x32x32": _randn(1, 3, 32, 32), "4x3x64x64": _randn(4, 3, 64, 64)}),
    "transformer": ("nn.TransformerEncoder, 4 layers, d=128", _transformer,
                    {"1x32 tokens": _randn(1, 32, 128), "4x128 tokens": _randn(4, 128, 128)}),
    "loop_rnn": ("Python-loop RNN, one Linear(64) x16", LoopRNN,
                 {"batch 1": _randn(1, 64), "batch 256": _randn(256, 64)}),
    "chain200": ("200 elementwise ops", ElementwiseChain,
                 {"64": _randn(64), "256x256": _randn(256, 256)}),
    "gpt2": ("GPT-2-style stack, 2 blocks, d=256", GPT2Stack,
             {"1x16 tokens": _tokens(1, 16), "1x128 tokens": _tokens(1, 128)}),
}


def build(name: str, shape: str | None = None):
    """(model in eval mode, args tuple) for one (model, shape) cell; the small shape by default."""
    description, builder, shapes = MODELS[name]
    shape = shape or next(iter(shapes))
    torch.manual_seed(0)
    model = builder().eval()
    args = shapes[shape](torch.Generator().manual_seed(1))
    return model, args


class BareMode(TorchFunctionMode):
    """The floor of ``__torch_function__`` interposition: handle every call, record nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class RecorderMode(TorchFunctionMode):
    """The minimal recorder: per tensor output, keep (function, shape, a reference to the output).

    Holding every intermediate alive is what any keep-all-activations design must pay for."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.records.append((func, out.shape, out))
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self.records.append((func, item.shape, item))
        return out


def native_arm(model, args):
    def native():
        return model(*args)
    return native


def bare_arm(model, args):
    def bare():
        with BareMode():
            return model(*args)
    return bare


def recorder_arm(model, args):
    def recorder():
        with RecorderMode():
            return model(*args)
    return recorder


def trace_arm(model, args, package=None, compiled=None, **options):
    """``tl.trace`` of the package under test, or of ``package`` (see ``baseline_package``); with
    ``compiled`` True or False, on the compiled hot path (torchlens-accel) or on the pure-Python path."""
    if package is None:
        import torchlens as package  # the package under test (or, in a worker, whichever is installed)
    tl = package

    def traced():
        return tl.trace(model, args, **options).output
    return traced if compiled is None else on_path(package, compiled, traced)


def on_path(package, compiled: bool, fn):
    """``fn`` run with ``package``'s compiled hot path turned on or off (``capture.accel.use``) around it:
    two such arms time the compiled and the pure-Python path side by side in one process."""
    import importlib

    accel = importlib.import_module(f"{package.__name__}.capture.accel")
    if compiled and not accel.available():
        raise SystemExit("the compiled hot path is not built: pip install ./accel (or build it in place)")

    def switched():
        previous = accel.use(compiled)
        try:
            return fn()
        finally:
            accel.use(previous)
    return switched


def baseline_package(path: str, name: str = "torchlens_baseline"):
    """The torchlens source tree at ``path`` (another revision's ``src/torchlens``, for instance from
    ``git archive REV src/torchlens | tar -x -C DIR``) imported under another name, so that it runs side
    by side with the package under test in one process.  The package imports itself relatively, so
    the two copies share nothing but torch."""
    import importlib.util
    import os
    import sys

    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    _own_compiled_modules(package, name, path)
    return package


def _own_compiled_modules(package, name: str, path: str) -> None:
    """Give the baseline its own revision's compiled modules when they are built in place beside it
    (``DIR/accel/src/torchlens_accel/*.so`` for ``DIR/src/torchlens``): both revisions' builds share the
    module name ``torchlens_accel``, so each baseline module is loaded from its file under a name of its
    own.  Without them the baseline takes whatever ``torchlens_accel`` is importable, if its layout fits."""
    import glob
    import importlib
    import importlib.machinery
    import importlib.util
    import os

    built = os.path.join(os.path.dirname(os.path.dirname(path)), "accel", "src", "torchlens_accel")
    loader_module = importlib.import_module(f"{name}.capture.accel")
    for file in glob.glob(os.path.join(built, "_*.so")):
        module_name = os.path.basename(file).split(".")[0]
        full = f"{name}_accel.{module_name}"
        loader = importlib.machinery.ExtensionFileLoader(full, file)
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(full, file, loader=loader))
        loader.exec_module(module)
        if getattr(module, "ABI", None) == loader_module.ABI.get(module_name):
            loader_module._modules[module_name] = module


def machine_footer(fingerprint: dict, command: str) -> list:
    """The lines a generated docs table ends with: where it was measured, and the command that remeasures it."""
    fp = fingerprint
    return ["", f"Machine: torch {fp.get('torch')}, {fp.get('threads')} torch threads, {fp.get('device')}, "
            f"{fp.get('cpus')} CPUs, load {fp.get('load_1_5_15')}; measured {time.strftime('%Y-%m-%d')}.",
            "", "Command:", "", "```text", command, "```"]
