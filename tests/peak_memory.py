"""Peak memory a script's work adds, measured in a fresh process (the suite's own allocations stay out)."""

from __future__ import annotations

import os
import subprocess
import sys


def peak_growth_mib(script: str, folder) -> float:
    """Run ``script`` with ``folder`` as its one argument; it prints, last, how many MiB its peak resident
    memory grew over the work it measures (``resource.getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    path = os.path.join(folder, "peak_memory_script.py")
    with open(path, "w") as f:
        f.write(script)
    # Large blocks mapped, not carved from the heap: freed ones are returned, so the peak counts live memory only.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    done = subprocess.run([sys.executable, path, str(folder)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])
