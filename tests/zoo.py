"""A zoo of small real models covering the cases capture must get right.

Each entry builds ``(model, args, kwargs)`` from a seed; every model is deterministic given the seed and
small enough that the whole zoo traces in well under a second.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


class InplaceViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        y.relu_()
        z = y[:, :4]
        z += 1
        c = y.clone()
        c[:, 0] = 5.0
        v = c.view(-1)
        return v.sum() + y.t().contiguous().sum(0).mean()


class Pair(nn.Module):
    """Two modules in a row, seeded: the smallest model with module calls inside the root."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x))


class MultiOutput(nn.Module):
    def forward(self, x):
        a, b = torch.chunk(x, 2, dim=1)
        values, indices = torch.max(a * b, dim=1)
        return values, indices


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        y, h2 = self.gru(y)
        return self.out(y[:, -1])


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) * self.scale


class SharedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(self.fc(x))
        x = self.act(self.fc(x))
        return self.fc(x)


class LoopRNN(nn.Module):
    """A Python loop reusing one Linear 16 times, with a param-free body around it."""

    def __init__(self, steps=16):
        super().__init__()
        self.steps = steps
        self.cell = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.zeros_like(x)
        for _ in range(self.steps):
            h = torch.tanh(self.cell(x) + h)
            h = h * 0.5
        return h


class StepLoop(nn.Module):
    """A recurrent cell applied in a Python loop, reading the input at every step: the loop's edges from the input
    span ever more layers of the picture, the shape on which Graphviz's unbounded placement ran for minutes."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], 1)))
        return h


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            y = self.a(x)
        else:
            y = self.b(x)
        return F.softmax(y, dim=-1)


class Functional(nn.Module):
    """Ops in the root forward, outside any submodule, and tensors made inside forward."""

    def forward(self, x):
        ones = torch.ones(x.shape[-1])
        steps = torch.arange(x.shape[-1]).float()
        y = torch.sigmoid(x) * ones + steps
        return F.normalize(y, dim=-1)


class DictIO(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, batch, scale=1.0, mask=None):
        h = self.fc(batch["a"]) + batch["b"]
        if mask is not None:
            h = h * mask
        return {"h": h * scale, "aux": [h.mean(), h.std()]}


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = self.features(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def transformer_encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _g(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g)


class ActivationMadePerCall(nn.Module):
    """Builds its activation module inside forward, as T5 builds its loss and Mamba its activation: a
    module of the call but not of the model, a new object each forward."""

    def __init__(self, act=nn.GELU):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = act

    def forward(self, x):
        return self.act()(self.fc(x)) * 2


class Square(torch.autograd.Function):
    """``x * x`` with its backward written out and its input saved through ``ctx``: the plainest custom Function."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class DoubledInPlace(torch.autograd.Function):
    """Doubles its input in place and hands it back marked dirty, as in-place custom activations do: as ``apply``
    returns, torch clears the tensor's ``_backward_hooks`` (a torch call that makes no tensor) and moves its
    version counter once more, after the recorded ``mul_``."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def zoo(seed: int = 0) -> dict:
    """name -> (model, args, kwargs); models in eval mode unless the case is about training."""
    torch.manual_seed(seed)
    r = _g(seed)
    cases = {
        "mlp": (MLP().eval(), (r(4, 16),), {}),
        "inplace_views": (InplaceViews().eval(), (r(3, 8),), {}),
        "multi_output": (MultiOutput(), (r(3, 8),), {}),
        "recurrent": (Recurrent().eval(), (r(2, 5, 6),), {}),
        "batchnorm_train": (BatchNormNet().train(), (r(2, 3, 6, 6),), {}),
        "batchnorm_eval": (BatchNormNet().eval(), (r(2, 3, 6, 6),), {}),
        "shared_module": (SharedModule().eval(), (r(2, 8),), {}),
        "loop_rnn": (LoopRNN().eval(), (r(2, 8),), {}),
        "branchy": (Branchy().eval(), (r(2, 8),), {}),
        "functional": (Functional(), (r(2, 8),), {}),
        "dict_io": (DictIO().eval(), ({"a": r(2, 8), "b": r(2, 8)},), {"scale": 2.0, "mask": r(2, 8)}),
        "dropout_train": (Dropout().train(), (r(4, 8),), {}),
        "small_cnn": (SmallCNN().eval(), (r(2, 3, 8, 8),), {}),
        "transformer_fastpath": (transformer_encoder().eval(), (r(2, 5, 32),), {}),
    }
    return cases
