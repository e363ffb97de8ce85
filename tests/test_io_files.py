"""The files and paths that saving, loading and extracting are given: missing optional packages, paths of
unusual kinds, and what a loaded extraction holds open."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

import torchlens as tl

LOAD_EXTRACTED_WITHOUT_NUMPY = textwrap.dedent("""
    import sys
    sys.modules["numpy"] = None  # as if it were not installed
    import torch
    import torchlens as tl

    folder = sys.argv[1]
    try:
        tl.load_extracted(folder)
    except ImportError as exc:
        print(type(exc).__name__, exc)
    print(torch.equal(tl.load_extracted(folder, as_torch=True)["output_1"], torch.load(sys.argv[2])))
""")


def test_without_numpy_load_extracted_names_the_package_and_as_torch_still_reads(tmp_path):
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    tl.extract(model, [batch], ["output_1"], tmp_path / "features", progress=False)
    with torch.no_grad():
        torch.save(model(batch), tmp_path / "expected.pt")
    script = tmp_path / "without_numpy.py"
    script.write_text(LOAD_EXTRACTED_WITHOUT_NUMPY)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "features"), str(tmp_path / "expected.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "ImportError tl.load_extracted (it returns numpy arrays unless as_torch=True, which needs no numpy) needs "
        "numpy: pip install numpy",
        "True"]


def test_a_bytes_path_saves_loads_and_extracts_like_its_str(tmp_path):
    model, batch = nn.Linear(4, 2).eval(), torch.randn(3, 4)
    log = tl.trace(model, batch)
    folder = bytes(tmp_path / "run")  # os.fsencode: what os.listdir(b".") gives back
    assert log.save(folder) == str(tmp_path / "run")
    assert torch.equal(tl.load(folder)[-1].activation, log[-1].activation)
    log.save(folder, overwrite=True)
    assert tl.extract(model, [batch], ["output_1"], bytes(tmp_path / "features"), progress=False) == \
        str(tmp_path / "features")
    assert torch.equal(tl.load_extracted(bytes(tmp_path / "features"), as_torch=True)["output_1"], log[-1].activation)
