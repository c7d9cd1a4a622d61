"""tests/fatal_errors.py: a worker killed by a fatal signal leaves its stacks in the summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CRASHING = '''
import faulthandler

def test_fine():
    pass

def test_crash():
    faulthandler._sigsegv()  # a segfault, as native code gives one
'''


def test_a_dead_workers_stacks_are_in_the_summary_without_the_harness(tmp_path):
    (tmp_path / "test_crash.py").write_text(CRASHING)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("PYTEST_XDIST_WORKER", None)  # the run below has a controller of its own
    env.pop("KVSERVE_TEST_FAULTS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "fatal_errors", "-p", "no:cacheprovider",
                          "--max-worker-restart", "0", "test_crash.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    section = out[out.index("fatal errors in test workers"):out.index("short test summary info")]
    lines = section.splitlines()[1:-1]
    assert lines[0] == "gw0: Fatal Python error: Segmentation fault"
    assert f'gw0:   File "{tmp_path / "test_crash.py"}", line 8 in test_crash' in lines
    assert not any("/_pytest/" in line or "/xdist/" in line for line in lines)
    assert "1 failed, 1 passed" in out and "worker 'gw0' crashed while running 'test_crash.py::test_crash'" in out
