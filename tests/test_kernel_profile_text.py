"""The printed form of tl.report.kernel_profile where there is nothing to rank."""

import torch
import torch.nn as nn

import torchlens as tl


def test_a_forward_that_ran_no_torch_op_says_so_rather_than_print_an_empty_top_table():
    text = str(tl.report.kernel_profile(nn.Identity(), torch.randn(2, 3)))
    assert "KernelProfile of Identity: 0 ops" in text
    assert "the forward ran no torch ops: there is nothing to rank" in text
    assert "top 0 ops" not in text


def test_a_forward_with_ops_still_ranks_them():
    text = str(tl.report.kernel_profile(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), torch.randn(2, 3)))
    assert "top 2 ops by self CPU time:" in text and "ran no torch ops" not in text
