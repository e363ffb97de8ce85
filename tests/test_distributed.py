"""torchlens on torch.distributed: two gloo ranks on localhost, spawned, each bounded in time."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import torchlens as tl
from torchlens.debug.nonfinite import OTHER_RANKS
from collective_workers import collective_on_a_view
from distributed_workers import (LAYERS, KilledAfter, dataset, extract_share,
                                 extract_fsdp2, extract_fsdp2_uneven, extract_streams, extract_tensor_parallel,
                                 extract_through_ddp,
                                 gather_labels_some_ranks_lack, gather_skipped_by_one_rank, launch, rerun_joined,
                                 extract_with_a_slow_rank, extract_with_slow_ranks, save_to_one_path, traces)
from held_files import refuse_held_files

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


# Tests of how ranks meet, wait, refuse and resume, not of what each rank's capture records: they run in the
# suite's compiled-path run only (the Makefile leaves them out of the pure-Python run).
path_independent = pytest.mark.path_independent

JOINED = ["layer_000.safetensors", "layer_001.safetensors", "layer_002.safetensors", "manifest.json",
          "sample_index.safetensors"]


def values(results):
    for code, result in results:
        assert result is not None, f"a rank exited with code {code} before reporting"
        assert "error" not in result, result.get("traceback")
    return [result["value"] for _, result in results]


def single_process(n, batch_size, tmp_path):
    """The same data extracted in one process, batch by batch in dataset order."""
    folder = tl.extract(KilledAfter(0).eval(), DataLoader(dataset(n), batch_size=batch_size), LAYERS,
                        tmp_path / f"single-{n}", args_of=lambda b: b[0], progress=False)
    return tl.load_extracted(folder)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traces"))


@pytest.fixture(scope="module")
def traced(workdir):
    return values(launch(traces, 2, workdir, workdir))


def test_ddp_and_fsdp2_traces_are_bit_identical_with_plain_addresses(traced):
    for rank, got in enumerate(traced):
        assert got["ddp"]["equal"] and got["fsdp"]["equal"]
        assert got["ddp"]["addresses"] == ["fc1", "act", "fc2"]  # no "module." from the DDP wrapper
        assert got["fsdp"]["addresses"] == ["fc1", "act", "fc2"]
        assert (got["ddp"]["rank"], got["ddp"]["world_size"]) == (rank, 2)


def test_a_backward_through_a_traced_ddp_forward_warns_that_nothing_is_all_reduced(traced):
    for got in traced:  # DDP's forward does not run in a trace, so its reducer all-reduces nothing
        assert got["ddp"]["grads_are_local"]  # each rank's parameters hold its own gradient
        (message,) = got["ddp"]["grads_warned"]  # and the trace said so, with what to do
        assert "not the average over the ranks" in message and "model.zero_grad()" in message


def test_inside_ddp_no_sync_a_traced_backward_does_not_warn(traced):
    assert [got["ddp"]["no_sync_warned"] for got in traced] == [[], []]  # local gradients are what was asked for


def test_a_backward_through_a_traced_fsdp2_forward_leaves_the_untraced_sharded_gradients(traced):
    for got in traced:
        assert got["fsdp"]["grads_equal"] and got["fsdp"]["grad_types"] == ["DTensor"]


def test_an_op_label_site_on_a_fresh_fsdp2_model_meets_another_forward(traced):
    for got in traced:  # resolved against the first forward (more ops), met by a later one
        assert "the forward took another path than the reference trace" in got["fsdp"]["first_forward_site"]
        assert got["fsdp"]["module_site_zeroed"]  # a module site holds whichever forward it is


def test_fsdp2_all_gathers_from_its_forward_hooks_are_recorded_in_their_module(traced):
    fsdp = traced[0]["fsdp"]
    assert fsdp["collectives"] == ["all_gather_single", "all_gather_single"]  # one per sharded Linear
    assert fsdp["modules"] == ["fc1:1", "fc2:1"]  # issued by the pre-forward hook, inside the module call
    # The unsharded weight and bias of each Linear (their split-copy outputs and the parameter views made of
    # them), freed after it.
    assert sorted(fsdp["freed"]) == ["as_strided"] * 4 + ["split_with_sizes_copy"] * 4
    # (a read of them would read freed memory: torch does not check, and a collective over it crashed)


def test_fsdp2_ops_name_the_parameters_their_unsharded_copies_stand_for(traced):
    for got in traced:  # the linears read FSDP2's unsharded parameters, registered only during their forward
        assert got["fsdp"]["linear_params"] == [("fc1.weight", "fc1.bias"), ("fc2.weight", "fc2.bias")]
        assert got["fsdp"]["param_users"] == [("fc1.weight", ["linear"]), ("fc1.bias", ["linear"]),
                                              ("fc2.weight", ["linear"]), ("fc2.bias", ["linear"])]


def test_fsdp2_split_copy_is_recorded_and_validate_does_not_read_the_freed_parameters(traced):
    fsdp = traced[0]["fsdp"]
    assert len(fsdp["splits"]) == 4  # split_with_sizes_copy returns None and writes its out= tensors
    passed, mismatched, linears = fsdp["validate"]
    assert passed and mismatched == []
    assert len(linears) == 2 and all("memory was freed after the forward" in why for why in linears)


def test_collectives_in_forward_are_ops_named_by_collective_and_group(traced):
    for got in traced:
        c = got["collectives"]
        assert c["equal"]
        assert c["names"] == ["all_reduce", "all_reduce", "all_gather"]  # dist, functional, dist
        assert c["groups"] == [[0, 1]] * 3
        assert c["reduced_is_parent_of_mul"]  # the op after dist.all_reduce reads the collective, not fc
        assert c["reduced_value_saved"]  # and the saved value is the reduced one
        assert c["loaded_names"] == c["names"]  # a saved trace keeps which collectives ran (not their groups)
        assert c["validate_mismatched"] == []
        assert set(c["labels"]) <= set(c["validate_not_replayed"])  # replay never re-issues a collective


def test_a_nan_a_collective_received_from_another_rank_is_not_called_born_in_it(traced):
    """Rank 0's inputs are finite and rank 1's all_reduce sends it a NaN: rank 0 cannot tell it from one the
    collective made, so it names the collective as not certain, pointing at the other ranks; rank 1 names its input."""
    got = [t["nonfinite"] for t in traced]
    assert got[0]["origin"].startswith("allreduce") and got[0]["kind"] == "op" and not got[0]["certain"]
    assert got[0]["possible"] == (OTHER_RANKS,) and "run nonfinite_origin on every rank" in got[0]["text"]
    assert (got[1]["origin"], got[1]["kind"], got[1]["certain"]) == ("input_1:1", "input", True)


def test_the_flag_of_an_async_collective_taken_before_its_result_arrived_is_not_evidence(traced):
    # The flag recorded at issue was finite on rank 0; the report named the add after the wait as the certain origin.
    got = traced[0]["nonfinite_async"]
    assert got["origin"].startswith("add") and not got["certain"]
    assert got["possible"] == ("allreduce_1_2:1", OTHER_RANKS)
    assert traced[1]["nonfinite_async"]["origin"] == "input_1:1" and traced[1]["nonfinite_async"]["certain"]
    # No flag at all is recorded for it (to_pandas and the viewer read the same): the add after the wait has the NaN.
    finite = [got["nonfinite_async"]["finite"] for got in traced]
    assert [flags["allreduce_1_2:1"] for flags in finite] == [None, None]
    assert finite[0][traced[0]["nonfinite_async"]["origin"]] == (True, False)


def test_every_listed_torch_distributed_collective_is_recorded(traced):
    names = ["broadcast", "all_reduce_coalesced", "reduce", "reduce_scatter_single", "all_gather_single",
             "reduce_scatter", "all_to_all_single", "all_to_all", "scatter"]
    for rank, got in enumerate(traced):
        every = got["every"]
        assert every["equal"]
        # gather writes on its dst alone; send writes nothing, and recv writes on the rank that receives
        assert every["names"] == names + (["gather", "all_reduce"] if rank == 0 else ["all_reduce", "recv"])
        assert [name for name, is_async in zip(every["names"], every["async"]) if is_async] == ["all_reduce"]
        assert every["groups"] == [[0, 1]] * len(every["names"])


@pytest.fixture(scope="module")
def view_and_broadcast(tmp_path_factory):
    """Both ranks' results of ``collective_on_a_view`` (one launch serves the two tests below)."""
    return values(launch(collective_on_a_view, 2, str(tmp_path_factory.mktemp("view"))))


def test_a_collective_written_through_a_view_is_the_parent_of_a_later_read_of_its_base(view_and_broadcast):
    for got in view_and_broadcast:
        assert got["mul_read_reduced"] and got["fc_saved_before_the_write"]  # the values: y * 2 read reduced rows
        assert got["mul_parents"] == got["collective"]  # so the graph says y * 2 read the all_reduce, not fc
        assert got["mismatched"] == []  # and validate does not replay y * 2 from fc's unreduced output


def test_a_broadcast_received_from_another_rank_fills_torch_empty_whole(view_and_broadcast):
    """A broadcast sent from this rank reads its tensor (tests/test_distributed_uninitialized.py); one received,
    its source named by world rank or by group rank, writes the receiver's torch.empty whole."""
    sender, receiver = (got["undefined_after_broadcast"] for got in view_and_broadcast)
    assert sender == [] and receiver == ["empty", "empty"]  # the broadcasts' values are defined


@path_independent
def test_gather_of_a_label_one_rank_lacks_leaves_no_rank_waiting(tmp_path):
    zero, one = values(launch(gather_labels_some_ranks_lack, 2, str(tmp_path), timeout=45))
    assert "relu_1_2:1" in zero["labels"] and "relu_1_2:1" not in one["labels"]  # the graphs differ
    assert zero["gathered"] == [["linear_1_1:1", "relu_1_2:1"], ["linear_1_1:1"]]  # each rank what it has
    (row,) = zero["compare"]
    assert (row["first_op"], row["reason"]) == ("relu_1_2:1", f"the graph differs: relu_1_2:1 on the reference, "
                                                             f"{one['labels'][2]} here")
    assert "no rank has an op labelled 'relu_9_9:1'" in zero["mistyped"] and one["mistyped"] is None


def test_compare_finds_a_divergence_planted_on_one_rank(traced):
    got = traced[0]
    assert [row["diverges"] for row in got["agree"]] == [False]
    (row,) = got["planted"]
    fc2 = [label for label in got["labels"] if label.startswith("linear_2")][0]
    assert (row["rank"], row["first_op"], row["module"], row["origin"]) == (1, fc2, "fc2:1", "here")
    assert 0 < row["max_abs_diff"] < 1e-2
    assert row["ops_compared"] == got["labels"].index(fc2)  # every op before it agreed bit for bit
    assert [r["diverges"] for r in got["tolerated"]] == [False]
    assert got["metadata_only"] == 0


def test_gather_sends_a_tensor_parallel_activation_as_this_ranks_shard(traced):
    tp = traced[0]["tensor_parallel"]
    assert "DTensor" not in tp["types"]  # each rank's shard, a plain tensor, compared without a collective
    (row,) = tp["compare"]  # fc1's column shards differ between the ranks, as they should
    assert (row["first_op"], row["module"], row["reason"]) == ("linear_1_2:1", "fc1:1", "values differ")


@pytest.mark.parametrize("option, value, error, message", [
    # rtol="x" and rtol=nan failed inside torch.allclose; reference=True compared with rank 1,
    # 1.0 failed on a list index.
    ("rtol", "x", TypeError, r"compare: rtol='x' is a str; a tolerance is a number, 0 or more"),
    ("atol", float("nan"), ValueError, r"compare: atol=nan is not a number \(NaN\)"),
    ("reference", True, TypeError, r"compare: reference=True is a bool, not an int"),
    ("reference", 1.0, TypeError, r"compare: reference=1\.0 is a float, not an int"),
    # reference=5 was "reference rank 5 is not among the 2 traces", where reference is a position, not a rank.
    ("reference", 5, ValueError, r"compare: reference=5 is no position in traces, which holds 2 \(0 to 1\)"),
])
def test_compare_refuses_a_tolerance_or_reference_that_cannot_work(option, value, error, message):
    pytest.importorskip("pandas")
    log = tl.trace(torch.nn.Linear(3, 3), torch.randn(2, 3))
    with pytest.raises(error, match=message):
        tl.distributed.compare([log, log], **{option: value})
    assert not tl.distributed.compare([log, log]).diverges.any()


def test_distributed_readers_refuse_what_is_not_a_list_of_traces_or_a_trace():
    # compare(log) iterated the trace's ops ("'Op' object has no attribute 'ops'"); collectives(tensor) likewise.
    log = tl.trace(torch.nn.Linear(3, 3), torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"compare takes one trace per rank, in rank order .* got a single Trace"):
        tl.distributed.compare(log)
    with pytest.raises(TypeError, match=r"compare got None, which tl.distributed.gather returns on every rank but "
                                        r"dst: call compare on dst alone"):  # was "'NoneType' object is not iterable"
        tl.distributed.compare(None)
    with pytest.raises(TypeError, match=r"compare: traces\[1\] takes a Trace .* got Tensor"):
        tl.distributed.compare([log, torch.ones(1)])
    with pytest.raises(TypeError, match=r"collectives takes a Trace .* got Tensor"):
        tl.distributed.collectives(torch.ones(1))
    with pytest.raises(TypeError, match=r"gather: dst='0' is a str, not an int"):
        tl.distributed.gather(log, dst="0")


@pytest.mark.parametrize("timeout", [0, 0.0004])
def test_gather_refuses_a_wait_the_store_would_take_for_no_limit(timeout):
    # The store waits in whole milliseconds, 0 meaning forever: gather(timeout=0) never named an absent rank.
    log = tl.trace(torch.nn.Linear(3, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match=rf"gather: timeout={timeout} is below 0\.001; give the seconds every rank "
                                         r"has to arrive, a finite number of 0\.001 or more \(120\)"):
        tl.distributed.gather(log, timeout=timeout)
    # torch takes the wait as a timedelta, which overflowed with a bare OverflowError
    with pytest.raises(ValueError, match=r"gather: timeout=1000000000000000\.0 is above 1e\+09"):
        tl.distributed.gather(log, timeout=1e15)


def test_gather_refuses_a_dst_outside_its_process_group():
    # torch's gloo said only "invalid root rank: 1", after every rank had waited for the others.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        log = tl.trace(torch.nn.Linear(3, 3), torch.randn(2, 3))
        with pytest.raises(ValueError, match=r"gather: dst=1 is not a rank of the process group gathered over "
                                             r"\(ranks 0\); give the rank, in the world's numbering, that receives"):
            tl.distributed.gather(log, dst=1)
        (alone,) = tl.distributed.gather(log, dst=0)
    finally:
        dist.destroy_process_group()
    assert alone.rank == 0 and len(alone) == len(log.ops)


def test_a_tolerance_never_lets_integer_values_that_differ_agree():
    """rtol is for rounding: token ids 100000 and 100001 are within rtol=1e-5 of each other, and differ."""
    class Ids(torch.nn.Module):
        def __init__(self, offset):
            super().__init__()
            self.offset = offset

        def forward(self, x):
            return (x + self.offset) * 2

    x = torch.tensor([0, 5])
    (row,) = tl.distributed.compare([tl.trace(Ids(100_000), x), tl.trace(Ids(100_001), x)],
                                    rtol=1e-5, atol=1e-6).to_dict("records")
    assert row["diverges"] and (row["first_op"], row["ops_compared"]) == ("add_1_1:1", 1)
    (row,) = tl.distributed.compare([tl.trace(Ids(100_000), x), tl.trace(Ids(100_000), x)],
                                    rtol=1e-5).to_dict("records")
    assert not row["diverges"]


def test_compare_reads_per_rank_saves_too(traced, workdir):
    loaded = [tl.load(os.path.join(workdir, f"saved-{rank}")) for rank in range(2)]
    assert [(t.rank, t.world_size) for t in loaded] == [(0, 2), (1, 2)]
    (row,) = tl.distributed.compare(loaded).to_dict("records")
    assert (row["rank"], row["first_op"], row["origin"]) == tuple(traced[0]["planted"][0][k]
                                                                 for k in ("rank", "first_op", "origin"))


@path_independent
def test_ranks_saving_to_one_path_keep_one_trace_and_the_others_are_told_to_use_their_own(tmp_path):
    path = str(tmp_path / "run")
    zero, one = values(launch(save_to_one_path, 2, str(tmp_path), path))
    saved = [rank for rank, got in enumerate((zero, one)) if got["first"] == "saved"]
    assert len(saved) == 1  # one rank's trace is there, whole
    assert zero["first holds"] == one["first holds"] == saved[0]
    refused = (zero, one)[1 - saved[0]]
    # (a rank that arrived second got "Directory not empty", or was told to pass overwrite=True)
    assert "every rank needs its own folder" in refused["first"]
    # overwrite=True replaces this rank's own trace, never another rank's
    assert (zero, one)[saved[0]]["overwrite"] == "saved"
    assert "holds the trace rank" in refused["overwrite"] and "every rank needs its own folder" in refused["overwrite"]
    assert zero["overwrite holds"] == one["overwrite holds"] == saved[0]


def test_compare_names_the_reference_by_its_rank_not_its_position(traced, workdir):
    loaded = [tl.load(os.path.join(workdir, f"saved-{rank}")) for rank in (1, 0)]  # listed in another order
    (row,) = tl.distributed.compare(loaded).to_dict("records")
    assert (row["rank"], row["reference"]) == (loaded[1].rank, loaded[0].rank) == (0, 1)
    assert row["first_op"] == traced[0]["planted"][0]["first_op"]  # the same op differs, whichever is the reference


def test_distributed_extraction_equals_a_single_process_one(tmp_path):
    out, rr = str(tmp_path / "dist"), str(tmp_path / "round-robin")
    forwards = values(launch(extract_share, 2, str(tmp_path), out, 24, 4, -1, 0, 30.0, rr))
    assert [f["forwards"] for f in forwards] == [3, 3] and [f["round_robin_forwards"] for f in forwards] == [3, 3]
    assert all("the ranks were given different inputs" in f["per_rank_error"] for f in forwards)
    assert [f["process_groups"] for f in forwards] == [1, 1]  # each call's barrier group is gone with it
    expected = single_process(24, 4, tmp_path)
    for folder in (out, rr):
        got = tl.load_extracted(folder)
        assert list(got) == LAYERS
        for name in LAYERS:
            assert isinstance(got[name], np.memmap)
            np.testing.assert_array_equal(got[name], expected[name])
        np.testing.assert_array_equal(tl.distributed.sample_index(folder), np.arange(24))
        assert sorted(os.listdir(folder)) == JOINED  # rank folders removed once joined

    # Called again, the same call returns the joined result; another one is refused (it returned the old rows).
    again = values(launch(rerun_joined, 2, str(tmp_path), out, rr, 24, 4))
    for got in again:
        assert (got["same"], got["same stream"]) == (0, 0)  # no forward: nothing redone
        assert "holds an extraction of KilledAfter layers ['inner.fc1', 'inner.act', 'inner']; this call asks " \
               "for KilledAfter layers ['inner.fc1']" in got["other layers"]
        assert "was extracted with another KilledAfter (its parameters or buffers differ" in got["other weights"]
    ((_, alone),) = launch(extract_share, 1, str(tmp_path), out, 24, 4)
    assert f"{out} was extracted by 2 ranks, and this call runs 1" in alone["error"]


@path_independent
def test_distributed_extraction_stores_a_layer_a_row_per_example_by_its_batch_dim(tmp_path):
    # Each rank stores its rows with the batch dim first, so the join copies examples; the dim is part of the job a
    # call into the joined result must match, as in one process (checked here as each rank checks it on a rerun).
    from test_extract_batch_dim import AltUp, rows, streams_by_row
    from torchlens.distributed.extraction import _check_rerun, _job

    out, model, data = str(tmp_path / "dist"), AltUp().eval(), rows([2, 2, 2, 2])
    assert values(launch(extract_streams, 2, str(tmp_path), out, {"streams": 1})) == ["extracted"] * 2
    assert torch.equal(tl.load_extracted(out, as_torch=True)["streams"], streams_by_row(model, data))
    for rank in (0, 1):
        _check_rerun(out, rank, 2, _job(model, data, ["streams"], None, False, None, rank, 2, {"streams": 1}))
        with pytest.raises(tl.io.ResumeMismatchError, match=r"batch_dim: \{'streams': 1\} then, None now"):
            _check_rerun(out, rank, 2, _job(model, data, ["streams"], None, False, None, rank, 2))


@path_independent
def test_a_distributed_extraction_refuses_a_folder_holding_a_one_process_one(tmp_path):
    # The join wrote over the folder's layer files and left its progress.json: a one-process call for the old
    # layers then returned at once, and load_extracted gave the distributed call's layers instead.
    single_process(8, 4, tmp_path)
    folder = tmp_path / "single-8"
    before = sorted(os.listdir(folder))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(tl.io.TraceFileError, match=r"holds a one-process extraction \(progress\.json\); a "
                                                       r"distributed tl\.extract writes .* into a folder of its own"):
            tl.extract(KilledAfter(0).eval(), DataLoader(dataset(8), batch_size=4), LAYERS[:1], folder,
                       args_of=lambda b: b[0], progress=False)
    finally:
        dist.destroy_process_group()
    assert sorted(os.listdir(folder)) == before and list(tl.load_extracted(folder)) == LAYERS


def test_the_join_lets_go_of_the_rank_files_before_removing_their_folders(tmp_path, monkeypatch):
    # Windows refuses to delete a file that is mapped: the join's own maps of the rank files must be gone.
    from torchlens.distributed.extraction import join_ranks
    from torchlens.io.extract import extract_folder
    from torchlens.io.extract_args import batch_reader

    out, batches = str(tmp_path / "joined"), list(DataLoader(dataset(8), batch_size=2))
    for rank in (0, 1):  # each rank's share as extract_ranks writes it, round-robin by batch
        mine = batches[rank::2]
        rows = {k: torch.arange(2 * (2 * k + rank), 2 * (2 * k + rank) + 2) for k in range(len(mine))}
        extract_folder(KilledAfter(0).eval(), mine, LAYERS, os.path.join(out, f"rank-{rank}"),
                       arguments_of=batch_reader(lambda b: b[0], None, None), kwargs={}, shard_bytes=1 << 20,
                       progress=False, indices_of=rows.__getitem__)
    refuse_held_files(monkeypatch)
    join_ranks(out, 2)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == JOINED
    got, expected = tl.load_extracted(out), single_process(8, 2, tmp_path)
    for name in LAYERS:
        np.testing.assert_array_equal(got[name], expected[name])


def test_a_ddp_wrapped_model_is_extracted_as_the_model_it_wraps(tmp_path):
    out = str(tmp_path / "ddp")
    assert values(launch(extract_through_ddp, 2, str(tmp_path), out, 16, 4)) == [2, 2]  # each rank its share
    expected = single_process(16, 4, tmp_path)
    got = tl.load_extracted(out)
    for name in LAYERS:  # the layers named as in the plain model, not module.inner.fc1; rows in dataset order
        np.testing.assert_array_equal(got[name], expected[name])
    np.testing.assert_array_equal(tl.distributed.sample_index(out), np.arange(16))


def test_an_fsdp2_model_is_extracted_as_the_plain_one(tmp_path):
    """Its sharded parameters (DTensors) are checksummed by this rank's shard, and its first forward, which makes
    the unsharded parameters and so runs more ops, gives the same layers as the later ones."""
    out = str(tmp_path / "fsdp2")
    assert values(launch(extract_fsdp2, 2, str(tmp_path), out, 16, 4)) == [2, 2]  # the rerun redid nothing
    expected = single_process(16, 4, tmp_path)
    got = tl.load_extracted(out)
    for name in LAYERS:
        np.testing.assert_array_equal(got[name], expected[name])


@path_independent
def test_an_fsdp2_model_given_uneven_shares_is_refused_on_every_rank_instead_of_waiting(tmp_path):
    out = str(tmp_path / "fsdp2-uneven")  # 5 batches, two ranks: rank 0 has a third forward, rank 1 none
    for got in values(launch(extract_fsdp2_uneven, 2, str(tmp_path), out, 5, timeout=45)):
        assert got["forwards"] == 2  # both ran two forwards together and stopped before the third
        assert "but rank 0 has forward number 3 to run and rank 1 has none" in got["error"]
        assert "a DistributedSampler" in got["error"] and "a multiple of the world size (2)" in got["error"]


@path_independent
def test_a_tensor_parallel_model_is_refused_since_its_ranks_need_the_same_batches(tmp_path):
    out = str(tmp_path / "tp")
    for error in values(launch(extract_tensor_parallel, 2, str(tmp_path), out)):  # each rank would get other rows
        assert error is not None and "fc1.weight is a tensor-parallel DTensor parameter" in error
        assert "Extract the model before parallelize_module" in error
    assert not os.path.exists(os.path.join(out, "rank-0"))


@path_independent
def test_uneven_shares_lose_and_duplicate_nothing(tmp_path):
    out = str(tmp_path / "dist")
    values(launch(extract_share, 2, str(tmp_path), out, 21, 4))  # the sampler pads rank 1 with sample 0
    np.testing.assert_array_equal(tl.distributed.sample_index(out), np.arange(21))
    expected = single_process(21, 4, tmp_path)
    for name in LAYERS:  # other batch shapes: the same rows, up to matmul rounding
        np.testing.assert_allclose(tl.load_extracted(out)[name], expected[name], rtol=1e-6, atol=1e-6)


@path_independent
def test_a_killed_rank_is_named_and_the_rerun_redoes_only_its_uncommitted_batches(tmp_path):
    out = str(tmp_path / "dist")
    first = launch(extract_share, 2, str(tmp_path), out, 48, 4, 1, 4, 5.0)
    (code0, result0), (code1, result1) = first
    assert code1 == -9 and result1 is None  # rank 1 was killed in its 4th forward
    assert "rank 1 did not reach the end of its share" in result0["error"]
    progress = json.loads(pathlib.Path(out, "rank-1", "progress.json").read_text())
    committed = progress["batches_done"]
    assert 1 <= committed < 6 and not progress["complete"]
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    for read in (tl.load_extracted, tl.distributed.sample_index):  # sample_index said only "manifest.json: missing"
        with pytest.raises(tl.io.TraceFileError, match="distributed extraction is incomplete .* run the same torchrun"):
            read(out)

    again = values(launch(extract_share, 2, str(tmp_path), out, 48, 4))
    assert again[0]["forwards"] == 0  # rank 0 had finished: nothing redone
    assert again[1]["forwards"] == 6 - committed  # rank 1 redid exactly what it had not committed
    expected = single_process(48, 4, tmp_path)
    got = tl.load_extracted(out)
    for name in LAYERS:
        np.testing.assert_array_equal(got[name], expected[name])
    np.testing.assert_array_equal(tl.distributed.sample_index(out), np.arange(48))
    assert sorted(os.listdir(out)) == JOINED

    rerun = values(launch(extract_share, 2, str(tmp_path), out, 48, 4))  # a finished extraction returns at once
    assert [r["forwards"] for r in rerun] == [0, 0]


@path_independent
def test_every_rank_waits_barrier_timeout_for_a_slower_rank_0_not_the_process_group_timeout(tmp_path):
    # Ranks other than 0 waited at gloo's monitored_barrier for the process group's timeout (3 s here): rank 1
    # gave up on a rank 0 4 s slower, with barrier_timeout=60, and rank 0 then failed too.
    zero, one = values(launch(extract_with_slow_ranks, 2, str(tmp_path), str(tmp_path), (0, 4.0, 60.0),
                              (1, 3.0, 1.0), group_timeout=3))
    assert (zero[0], one[0]) == ("extracted", "extracted")
    expected = single_process(16, 4, tmp_path)
    for name in LAYERS:
        np.testing.assert_array_equal(tl.load_extracted(tmp_path / "slow-0")[name], expected[name])
    # barrier_timeout=1 and rank 1 3 s slower: rank 0 names it; rank 1, once done, is told it is too late, not
    # that a rank "did not reach the end of its share" (every share was complete)
    assert zero[1].startswith("rank 1 did not reach the end of its share within 1s: it died, hung or raised")
    assert one[1].startswith("every rank has finished its share, but another rank stopped waiting at the end of its "
                             "share before this one arrived (its 1s passed first, or it died since). Nothing is lost")


@path_independent
def test_a_rank_that_does_not_call_extract_is_named_on_the_ranks_that_do(tmp_path):
    zero, one = values(launch(extract_with_a_slow_rank, 2, str(tmp_path), str(tmp_path / "absent"), 1, 0, 1.0,
                              False, timeout=30))
    assert one is None  # it never called tl.extract
    assert zero.startswith("rank 1 did not call tl.extract within 1s of this rank: under torch.distributed every "
                           "rank must call it, like a collective")


@path_independent
@pytest.mark.parametrize("absent", [1, 0])
def test_a_rank_that_does_not_call_gather_is_named_on_the_ranks_that_do(tmp_path, absent):
    # The group's timeout is 60 s and each rank is killed at 30: only gather's own wait can answer in time.
    results = values(launch(gather_skipped_by_one_rank, 2, str(tmp_path), absent, 1.0, timeout=30))
    (message,) = [got for rank, got in enumerate(results) if rank != absent]
    assert message.startswith(f"rank {absent} did not call tl.distributed.gather within 1s of this rank")
    assert "every rank of the process group must call it" in message


def test_outside_a_process_group_a_trace_has_no_rank():
    log = tl.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
    assert (log.rank, log.world_size) == (None, None)
    assert len(tl.distributed.collectives(log)) == 0


@path_independent
def test_importing_torchlens_does_not_import_its_distributed_package():
    import subprocess
    import sys

    code = "import sys, torchlens; print('torchlens.distributed' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120).stdout.strip() == "False"


def test_a_loaded_trace_does_not_take_torch_gather_or_scatter_for_collectives(tmp_path):
    def picks(x):  # indexing ops that share their names with torch.distributed.gather and scatter
        index = torch.zeros(2, 1, dtype=torch.long)
        return torch.gather(x, 1, index) + x.scatter(1, index, 1.0).sum()

    log = tl.trace(picks, torch.randn(2, 3))
    assert {"gather", "scatter"} <= {op.func_name for op in log.ops}
    loaded = tl.load(log.save(tmp_path / "picks"))
    assert list(tl.distributed.collectives(loaded)["label"]) == list(tl.distributed.collectives(log)["label"]) == []
    again = tl.load(loaded.save(tmp_path / "picks-again"))  # saved again, it keeps what each call was
    assert again.saved_func_paths == loaded.saved_func_paths
    assert [p.rsplit(".", 1)[-1] for p in again.saved_func_paths] == [c.func.__name__ for c in log.calls]


def test_root_naming_the_traced_wrapper_traces_the_module_it_wraps():
    from distributed_workers import MLP

    model, x = MLP(), torch.randn(3, 8)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        named = tl.trace(ddp, x, root=ddp)  # root= the wrapper itself: the same trace as without root=
        plain = tl.trace(ddp, x)
    finally:
        dist.destroy_process_group()
    assert named.model is model and [c.label for c in named.module_calls] == ["fc1:1", "act:1", "fc2:1"]
    assert [op.label for op in named.ops] == [op.label for op in plain.ops]
    assert torch.equal(named.output, model(x))
    wrapper = torch.nn.DataParallel(model)
    assert tl.trace(wrapper, x, root=wrapper).model is model
    with pytest.raises(ValueError, match=r"traced model is already a module \(MLP\) and root= is another "
                                         r"\(Linear\): drop root="):
        tl.trace(model, x, root=torch.nn.Linear(2, 2))


def _coalesced_gather(x):
    y = x * 2
    parts = [[torch.empty_like(y), torch.empty_like(x)]]  # one rank: a list of one list, slots (0, 0) and (0, 1)
    dist.all_gather_coalesced(parts, [y, x])
    return parts[0][0] + parts[0][1]


def test_a_collective_writing_a_list_of_lists_is_listed_once(tmp_path):
    # all_gather_coalesced's outputs are slots (0, 0), (0, 1): the table took none of them for its first output.
    import warnings

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # all_gather_coalesced is deprecated in torch
            log = tl.trace(_coalesced_gather, torch.randn(3))
        table = tl.distributed.collectives(log)
    finally:
        dist.destroy_process_group()
    (written,) = [op.parents for op in log.ops if op.func_name == "add"]
    assert list(table["collective"]) == ["all_gather_coalesced"] and list(table["group_ranks"]) == [[0]]
    assert [log[label].func_name for label in written] == ["all_gather_coalesced"] * 2
    assert list(table["label"]) == written[:1]  # one row per call, named by its first output
    loaded = tl.load(log.save(tmp_path / "coalesced"))
    assert list(tl.distributed.collectives(loaded)["label"]) == list(table["label"])
