"""A module call sees the same tensors as the trace, at any depth of its arguments and output, whether
passed by position or by keyword."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

import torchlens as tl

sys.path.insert(0, os.path.dirname(__file__))  # the real-model corpus lives beside this file


class DeepIn(nn.Module):
    def forward(self, nested):
        return nested["a"][0][0][0][0][0] * 2  # six levels down: deeper than any fixed depth limit


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DeepIn()

    def forward(self, x):
        y = x + 1
        return self.inner({"a": [[[[[y]]]]]})


def test_a_deeply_nested_module_input_is_the_op_that_made_it():
    log = tl.trace(Outer(), torch.randn(3))
    call = log.module_calls[0]
    made = log["add_1_1:1"]
    assert [i for i in call._input_nodes if i >= 0] == [made.index]


class Attention(nn.Module):
    """Takes its tensors by keyword, as transformers' attention layers are called."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states, mask=None, scale=1.0):
        return self.proj(hidden_states) * mask * scale


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, mask):
        h = x + 1
        by_keyword = self.attn(hidden_states=h, mask=mask, scale=2.0)
        mixed = self.attn(h, mask=mask)
        return by_keyword + mixed


def test_tensors_passed_by_keyword_are_module_call_inputs():
    x, mask = torch.randn(2, 4), torch.ones(2, 4)
    log = tl.trace(Layer(), (x, mask))
    by_keyword, mixed = [c for c in log.module_calls if c.address == "attn"]
    # Positional arguments' tensors first, then the keyword ones', in the order they were passed.
    assert by_keyword.input_ops == ["add_1_1:1", "input_2:1"]
    assert mixed.input_ops == ["add_1_1:1", "input_2:1"]
    assert log.summary()["attn:1"]["input_shapes"] == [(2, 4), (2, 4)]


def test_a_transformers_attention_layer_called_by_keyword_lists_its_input():
    pytest.importorskip("transformers")
    import real_models  # imports transformers lazily, per entry

    model, args, kwargs = real_models.build("llama")
    log = tl.trace(model, args, kwargs)
    attention = [c for c in log.module_calls if c.address == "model.layers.0.self_attn"][0]
    norm = [c for c in log.module_calls if c.address == "model.layers.0.input_layernorm"][0]
    # Llama's decoder layer calls self_attn(hidden_states=..., position_embeddings=(cos, sin), ...).
    assert attention.input_ops[0] == norm.output_ops[0]
    assert len(attention.input_ops) >= 3  # the hidden states, cos and sin, and the mask when one is made
    root = log.module_calls[0]
    assert root.input_ops[:2] == ["input_1:1", "input_2:1"]  # input_ids=..., attention_mask=...


# The one walk up the module-call tree is record.modules.enclosing_calls.  labels/ sits below record and cannot
# import it; save='s during-forward selection test stops at the first selected module, per op.
_OWN_ANCESTRY_WALKS = {"record/modules.py", "labels/passes.py", "capture/saving.py"}


def _ancestry_loops(path) -> list:
    """``while c >= 0:`` loops that step to a module call's parent (``.parent``, ``parents[c]``, ``*PARENT``);
    not viz's walks up its drawing groups (``groups[g].parent``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.While):
            continue
        first = node.test.values[0] if isinstance(node.test, ast.BoolOp) else node.test
        if not (isinstance(first, ast.Compare) and isinstance(first.ops[0], ast.GtE)):
            continue
        steps = [n for stmt in node.body for n in ast.walk(stmt)
                 if (isinstance(n, ast.Attribute) and n.attr == "parent")
                 or (isinstance(n, ast.Name) and (n.id == "parents" or n.id.endswith("PARENT")))]
        drawing_groups = any(isinstance(n, (ast.Name, ast.Attribute)) and "groups" in (getattr(n, "id", None) or
                                                                                 getattr(n, "attr", ""))
                             for stmt in node.body for n in ast.walk(stmt))
        if steps and not drawing_groups:  # viz's boxes form a tree of their own, walked to a focus
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_module_call_tree_is_walked_by_one_helper():
    import importlib.util
    import pathlib

    src = pathlib.Path(importlib.util.find_spec("torchlens").submodule_search_locations[0])
    found = [f"{p.relative_to(src).parent}/{hit}" for p in sorted(src.rglob("*.py"))
             if p.relative_to(src).as_posix() not in _OWN_ANCESTRY_WALKS for hit in _ancestry_loops(p)]
    assert not found, "module-call ancestry walked by hand (use record.modules.enclosing_calls):\n" + "\n".join(found)


def test_enclosing_calls_on_a_real_model_matches_each_op_s_module_calls():
    from torchlens.record.modules import enclosing_calls

    log = tl.trace(Outer(), torch.randn(2))
    parent_of = log.module_call_parents.__getitem__
    for op, m in zip(log.ops, log.module_call_indices):
        labels = [log.module_calls[k].label for k in reversed(enclosing_calls(m, parent_of))]
        assert tuple(labels) == op.modules
    assert enclosing_calls(-1, parent_of) == []
    assert [c.depth for c in log.module_calls] == [0]
