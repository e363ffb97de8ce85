"""Every benchmark script imports: a moved module or renamed helper breaks them loudly here, not the day
someone needs the figures.  Nothing is measured (each script runs only under ``__main__``); the scripts whose
arms reach into the package's internals or its refusals also have each arm run once."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

import torchlens

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load(script: pathlib.Path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_benchmark_script_imports(script, monkeypatch):
    module = _load(script, monkeypatch)
    assert callable(getattr(module, "main", None)) or script.name == "models.py", f"{script.name} has no main()"


def test_each_step_the_fixed_cost_benchmark_times_runs(monkeypatch):
    """``fixed_cost.py --steps`` calls the driver's helpers by name: a helper moved to another module must
    break this, not the next measurement."""
    fixed_cost = _load(BENCHMARKS / "fixed_cost.py", monkeypatch)
    torch.manual_seed(0)
    model, wide = fixed_cost.OneOp().eval(), fixed_cost.MLP(10, 8)
    deep = fixed_cost.SmallResNet((8, 16, 32)).eval()
    with torch.no_grad():
        steps = fixed_cost.step_arms(model, torch.randn(4), torchlens, wide, deep)
        assert len(steps) > 20
        for step in steps.values():
            step()


@pytest.mark.parametrize("row", ["mlp20", "loop_rnn"])
def test_each_arm_of_the_intervention_benchmark_runs_and_edits(row, monkeypatch):
    """Every arm runs (an arm that tl.trace now refuses breaks this), and each intervened arm returns the
    edited output its hooked baseline returns."""
    bench = _load(BENCHMARKS / "intervene_overhead.py", monkeypatch)
    with torch.no_grad():
        arms, _, ops = bench.row_arms(row)
        outputs = {name: arm() for name, arm in arms.items()}
    assert ops > 10
    assert torch.equal(outputs["module site"], outputs["hooked"])
    assert torch.equal(outputs["label site, ref"], outputs["hooked"])
    assert torch.equal(outputs["trace none"], outputs["native"])
    assert not torch.equal(outputs["hooked"], outputs["native"])


def test_each_part_the_fixed_cost_parts_benchmark_replaces_exists_and_a_one_op_trace_runs_without_it(monkeypatch):
    """``fixed_cost_parts.py`` replaces driver parts by name (a renamed part must break this, not be skipped
    in silence), and counts a one-op trace with each gone: that trace must still run and record its op."""
    parts = _load(BENCHMARKS / "fixed_cost_parts.py", monkeypatch)
    from torchlens.capture import session

    class OneOp(torch.nn.Module):
        def forward(self, x):
            return x + 1

    x = torch.randn(4)
    with torch.no_grad():
        labels = [op.label for op in torchlens.trace(OneOp(), x).ops]  # the input, add_1_1 and the output
    for name, stand_in in parts.PARTS.values():
        assert hasattr(session, name), f"the driver has no {name}: update fixed_cost_parts.PARTS"
        with monkeypatch.context() as patched, torch.no_grad():
            patched.setattr(session, name, stand_in)
            log = torchlens.trace(OneOp(), x)
        assert torch.equal(log.output, x + 1)
        assert [op.label for op in log.ops] == labels


def test_the_reference_worker_loads_the_harness_where_torchlens_is_another_library(tmp_path):
    """``overhead_matrix.py --ref-python`` runs a worker in the reference library's environment, where
    ``import torchlens`` is that library: the worker must still load this checkout's harness (and everything it
    imports) and measure with it, without importing ``torchlens`` at all."""
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(
        "import sys\n"
        "sys.modules['torchlens'] = None  # any import of torchlens now fails, as it would name the other library\n"
        f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
        "sys.argv = ['overhead_matrix.py', '--ref-worker']\n"
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('overhead_matrix', "
        f"{str(BENCHMARKS / 'overhead_matrix.py')!r})\n"
        "matrix = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(matrix)\n"
        "h = matrix.harness()\n"
        "result = h.measure_overhead(lambda: 1, lambda: 1, pairs=3, warmup=1, repeats=1,\n"
        "                            predicate=h.RefusalPredicate(min_pairs=3, max_relative_iqr=10))\n"
        "print('pairs', result.pairs, 'equal', result.outputs_equal)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pairs 3 equal 3" in done.stdout


@pytest.mark.parametrize("shape", ["chain", "loop", "branches"])
def test_each_step_the_call_count_benchmark_counts_runs(shape, monkeypatch, tmp_path):
    """``scale_calls.py`` counts each step on three shapes: a step the trace refuses on one of them (a
    predicate site on the loop's repeated passes) must fail here, not after minutes of counting."""
    import gc

    scale_calls = _load(BENCHMARKS / "scale_calls.py", monkeypatch)
    torch.manual_seed(0)
    # counted() runs a full collection before each step: with the test process's heap frozen, each scans
    # only what the steps made (the whole heap took seconds per step, for a count that needs only be > 0).
    gc.freeze()
    try:
        for name, step in scale_calls.steps(scale_calls.SHAPES[shape](2), torch.randn(2, 8), str(tmp_path)).items():
            assert scale_calls.counted(step) > 0, name
    finally:
        gc.unfreeze()


def test_the_bytecode_count_sees_the_trace_driver_and_restores_the_tracer(monkeypatch):
    """``trace_bytecodes.py`` attributes each bytecode and C call to the function running it: a trace's count
    names the driver (``_trace``), a first read's the label derivation, and the tracer in place before (coverage's,
    a debugger's) is back after."""
    bench = _load(BENCHMARKS / "trace_bytecodes.py", monkeypatch)
    before = sys.gettrace()
    if sys.version_info[:2] != (3, 11):  # said, rather than a table of zeros or short counts
        with pytest.raises(RuntimeError, match="counted on CPython 3.11 only"):
            bench.count(torchlens, pure=True, grads=False, read=False, traces=1)
        return
    traced = bench.count(torchlens, pure=True, grads=False, read=False, traces=1)
    read = bench.count(torchlens, pure=False, grads=True, read=True, traces=1)
    assert sys.gettrace() is before
    assert traced.bytecodes["session.py:_trace"] > 100 and sum(traced.c_calls.values()) > 10
    assert read.bytecodes["passes.py:group_ops"] > 0 and "session.py:_trace" not in read.bytecodes
    assert "| this |" in bench.table({"this": traced}, 1, 5)
