"""``torch.compile``'d functions a traced forward calls (capture/compiled_functions.py): they run compiled, as
untraced, with capture out of the way on both capture paths: none of their ops or module calls is recorded, their
results enter the trace with no parent op, the trace names them in a caveat, and Dynamo compiles nothing again
for the trace.  Each test compiles once, on CPU, and traces the compiled code it made."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn as nn

import torchlens as tl
from untouched import assert_clean_process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True, scope="module")
def _collect_compile_garbage():
    yield
    gc.collect()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class CallsCompiledFunctions(nn.Module):
    """A compiled method and a compiled module call, as transformers compiles a decoding step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.out = Inner(), nn.Linear(8, 2)
        self.body = torch.compile(self._body)
        self.call = torch.compile(self.inner.__call__)

    def _body(self, x):
        return self.inner.fc(x).sin() * 2

    def forward(self, x):
        return self.out(self.body(x)) + self.out(self.call(x))


def test_a_compiled_function_runs_as_untraced_with_nothing_of_its_interior_recorded():
    """Inductor's generated code calls ``extern_kernels.addmm``, which capture saw as a loose op with no module and
    no parents, while its fused kernels went unseen; the compiled module call was ``inner:1`` on the pure-Python
    path only; and Dynamo compiled the functions again, tracing capture itself."""
    model, x = CallsCompiledFunctions(), torch.randn(3, 8)
    expected = model(x)  # compiled here, and only here
    with dynamo.config.patch(error_on_recompile=True):
        with pytest.warns(UserWarning, match=r"torch.compile'd functions \(CallsCompiledFunctions._body, "
                                             r"Inner.__call__\) ran compiled"):
            log = tl.trace(model, x)
    assert torch.equal(log.output, expected)
    assert [(op.label, op.module) for op in log.ops if op.kind == "op"] == \
        [("linear_1_1:1", "out:1"), ("linear_1_1:2", "out:2"), ("add_1_2:1", None)]
    assert [c.label for c in log.module_calls] == ["out:1", "out:2"] and log.unattributed == 2
    assert len(log.caveats) == 1 and "disable_compile=True" in log.caveats[0]
    assert "read by linear_1_1:1" in str(log)
    assert_clean_process()


def test_generate_compiling_its_decoding_steps_records_the_prefill_alone_and_names_the_compiled_call():
    """A static cache makes generate() compile the model's call for the decoding steps: those steps recorded no
    module calls, and inductor's ``mm`` and attention kernels entered the trace as loose ops."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(config).eval(), torch.randint(0, 100, (1, 5))
    # Dynamo's entry is the same whatever the backend: aot_eager's ATen graph compiles in seconds, and recorded its ops
    # as loosely as inductor's generated code did.
    model.generation_config.compile_config = transformers.CompileConfig(backend="aot_eager")
    model.generation_config.compile_config._compile_all_devices = True  # it compiles on CUDA alone otherwise
    generate = {"max_new_tokens": 3, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(ids, **generate)
    with dynamo.config.patch(error_on_recompile=True):
        with pytest.warns(UserWarning, match=r"torch.compile'd functions \(GPT2LMHeadModel.__call__\)"):
            log = tl.trace(model.generate, (ids,), generate)
    assert torch.equal(log.output, expected)
    assert [c.label for c in log.module_calls if c.address == "self"] == ["self:1"]  # the prefill, run eagerly
    kernels = ("mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu")  # inductor's code calls these
    assert [op.label for op in log.ops if op.func_name in kernels and not op.modules] == []
    assert log.unattributed > 0 and "disable_compile=True" in log.caveats[-1]
    assert_clean_process()


def test_an_interrupt_anywhere_in_stepping_aside_leaves_nothing_and_compiles_nothing_again():
    """A KeyboardInterrupt landing on each line of capture/compiled_functions.py in turn, as the trace enters and
    leaves its part and as a compiled function is stepped aside for and back: each time the stand-in is gone,
    nothing is left on the mode stack, and the next trace neither records more nor makes Dynamo compile again."""
    from interrupts import interrupt_every_line, signature
    from torchlens.capture import compiled_functions

    model, x = CallsCompiledFunctions(), torch.randn(3, 8)
    expected = model(x)
    with dynamo.config.patch(error_on_recompile=True), pytest.warns(UserWarning, match="ran compiled"):
        landed = interrupt_every_line(lambda: tl.trace(model, x),
                                      lambda code: code.co_filename == compiled_functions.__file__)
        log = tl.trace(model, x)
    assert landed > 50, landed
    assert torch.equal(log.output, expected) and torch.equal(model(x), expected)
    assert [label for label, *_ in signature(log)] == ["input_1:1", "linear_1_1:1", "linear_1_1:2", "add_1_2:1",
                                                         "output_1:1"]
