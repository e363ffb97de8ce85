"""The profiler join's rules on constructed events: which op a host event or kernel lands on (innermost marker,
same thread, boundaries), kernels linked by correlation or External id, and backward nodes by sequence number."""

from torchlens.report.profile_events import Event
from torchlens.report.profile_join import join, union_ns


def _host(name, start, end, thread=1, ext=None, seq=-1, backward=False):
    return Event(name, "cpu_op", start, end, thread, external_id=ext, seq=seq, backward=backward)


def _launch(start, end, corr, thread=1):
    return Event("cudaLaunchKernel", "cuda_runtime", start, end, thread, correlation=corr)


def _kernel(start, end, corr, stream=7):
    return Event("gemm", "kernel", start, end, stream, device="cuda:0", stream=stream, correlation=corr)


def test_join_rules_innermost_marker_same_thread_and_boundaries():
    run = 77
    events = [
        _host(f"torchlens::phase::{run}.forward", 0, 1000),
        _host(f"torchlens::module::{run}.0", 10, 500),
        _host(f"torchlens::op::{run}.0", 20, 200),
        _launch(20, 30, corr=1),  # starts exactly at the op's open: inside it
        _host(f"torchlens::op::{run}.1", 200, 300),  # opens exactly where op 0 closes
        _launch(300, 310, corr=2),  # starts exactly at op 1's close: not inside it, still in the module
        _launch(600, 610, corr=3),  # in the forward, outside any op or module call
        _launch(50, 60, corr=4, thread=2),  # inside op 0's time, but on another thread
        _host(f"torchlens::op::{run + 1}.0", 700, 800),  # another profile's marker: not ours
        _launch(710, 720, corr=5),
        _kernel(100, 150, 1), _kernel(140, 190, 2, stream=9), _kernel(400, 450, 3),
        _kernel(460, 470, 4), _kernel(900, 905, 5), _kernel(910, 915, 99),
        _host("aten::mm", 220, 280, ext=41),  # inside op 1
        Event("gemm", "kernel", 920, 930, 7, device="cuda:0", stream=7, correlation=98, external_id=41),
    ]
    joined = join(events, run)
    assert joined.op_forward[0][2] == 50 and joined.op_forward[0][3] == 1
    # op 1's kernel has no runtime event with its correlation: linked by its External id, and counted
    assert joined.op_forward[1][2] == 10 and joined.device_via_external_id == 1
    assert joined.module_direct[0][2] == 50  # corr 2: in module call 0 outside its ops
    assert joined.device_unattributed["forward_outside_ops"] == [2, 50 + 5]  # corr 3, and corr 5
    assert joined.device_unattributed["other_thread"] == [1, 10]
    assert joined.device_unattributed["no_launch_event"] == [1, 5]
    assert union_ns(joined.device_intervals["cuda:0"]) == 50 + 40 + 50 + 10 + 5 + 5 + 10
    assert union_ns(joined.attributed_intervals["cuda:0"]) == 90 + 10  # 100..190: two kernels overlap


def test_join_backward_follows_the_sequence_number_across_threads():
    run = 78
    events = [
        _host(f"torchlens::op::{run}.0", 0, 100),
        _host("aten::add_", 10, 20, seq=5),  # records seq 5 but creates no node
        _host(f"torchlens::op::{run}.1", 100, 200),
        _host("aten::mul", 110, 190, seq=5),  # the later op recording 5 created node 5
        _host("evaluate_function: MulBackward0", 500, 600, thread=3, seq=5, backward=True),
        _launch(510, 520, corr=8, thread=3),
        _host("evaluate_function: Orphan", 600, 650, thread=3, seq=9, backward=True),
        _kernel(700, 740, 8),
        # A loss after the forward: its add_ records 6 after op 1's clone did, and creates node 6.
        _host(f"torchlens::op::{run}.2", 200, 250),
        _host("aten::clone", 210, 220, seq=6),
        _host("aten::add_", 300, 310, seq=6),
        _host("evaluate_function: AddBackward0", 650, 660, thread=3, seq=6, backward=True),
    ]
    joined = join(events, run)
    # device: the kernel of the launch inside the node; self CPU: the node's 90 plus the launch's 10
    assert joined.op_backward[1][2] == 40 and joined.op_backward[1][0] == 90 + 10
    assert 0 not in joined.op_backward
    assert joined.host_unattributed["backward_without_op"] == [2, 50 + 10]
    assert 2 not in joined.op_backward
