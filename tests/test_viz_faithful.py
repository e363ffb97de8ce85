"""What a picture claims about the trace it draws: the counts on collapsed modules and the passes on rolled edges."""

from __future__ import annotations

import os
import re
import sys

import pytest

import torchlens as tl
from torchlens.viz import graph

sys.path.insert(0, os.path.dirname(__file__))
from zoo import zoo  # noqa: E402

COLLAPSED = re.compile(r'^\s*(m\d+) \[id="m\d+", class="tl-node tl-module".*?<font point-size="8">(\d+) ops?'
                       r"(?:, (\d+) buffers?)?</font>", re.M)


@pytest.fixture(scope="module")
def traces():
    return {name: tl.trace(model, args, kwargs) for name, (model, args, kwargs) in zoo(0).items()}


@pytest.mark.parametrize("name, depth", [("batchnorm_eval", 0), ("batchnorm_train", 0), ("small_cnn", 0),
                                         ("small_cnn", 1)])
def test_a_collapsed_module_counts_every_node_it_hides_buffers_included(traces, name, depth):
    log = traces[name]
    structure = graph.build_structure(log, "unrolled")
    found = COLLAPSED.findall(log.render(depth=depth))
    assert found
    for key, ops, buffers in found:
        hidden = structure.groups[int(key[1:])].items  # the op and buffer nodes the box stands for
        assert int(ops) + int(buffers or 0) == len(hidden), key
    assert any(buffers for _, _, buffers in found)  # batch norm's running statistics are buffers
