"""torchlens under macOS's and Windows's defaults, emulated here: processes started by spawn (every module
re-imported in the child, the model's class found again in the script's ``__main__``), a trace crossing
processes only as a saved folder, and file names Windows refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import torch
import torch.nn as nn

import torchlens as tl

SPAWNED = textwrap.dedent('''
    import json, multiprocessing as mp, os, sys
    import torch, torch.nn as nn
    import torchlens as tl

    class Net(nn.Module):  # defined in __main__: a spawned child finds it again by re-running this script
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.fc(x)) * 2

    def trace_and_save(path):
        log = tl.trace(Net(), torch.arange(8.0).reshape(2, 4))
        log.save(path)
        return [op.label for op in log.ops]

    def load_elsewhere_and_return_a_trace(path, queue, conn):
        """In another spawned process than the one that saved: load the trace, then send a new one back."""
        loaded = tl.load(path)
        queue.put([[op.label for op in loaded.ops], loaded[-1].activation.tolist()])
        try:
            conn.send(tl.trace(Net(), torch.ones(1, 4)))
        except TypeError as exc:
            conn.send(str(exc))

    if __name__ == "__main__":
        mp.set_start_method("spawn")
        path = os.path.join(sys.argv[1], "saved")
        with mp.Pool(1) as pool:
            labels = pool.apply(trace_and_save, (path,))
        queue = mp.Queue()
        near, far = mp.Pipe()
        child = mp.Process(target=load_elsewhere_and_return_a_trace, args=(path, queue, far))
        child.start()
        loaded_labels, output = queue.get(timeout=120)
        refusal = near.recv()
        child.join()
        expected = Net()(torch.arange(8.0).reshape(2, 4)).tolist()
        print(json.dumps({"labels": labels, "loaded": loaded_labels, "same_output": output == expected,
                          "refusal": refusal}))
''')


def test_traces_made_saved_and_loaded_in_spawned_processes_match_the_untraced_model(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["labels"] == found["loaded"] == ["input_1:1", "linear_1_1:1", "relu_1_2:1", "mul_1_3:1",
                                                  "output_1:1"]
    assert found["same_output"]
    assert "a Trace cannot be pickled" in found["refusal"] and "tl.load(path)" in found["refusal"]


def test_show_writes_its_file_whatever_characters_the_model_name_holds(monkeypatch):
    # A hub id holds a separator (a folder that does not exist); Windows refuses ':' and '?' in a file name.
    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    log = tl.trace(nn.Linear(3, 3), torch.randn(2, 3), name="facebook/opt-125m: run?")
    path = log.show()
    try:
        assert path.name.startswith("torchlens_facebook_opt-125m_run_") and str(path.parent) == tempfile.gettempdir()
        assert "tl-data" in path.read_text() and opened == [path.resolve().as_uri()]
    finally:
        path.unlink()
