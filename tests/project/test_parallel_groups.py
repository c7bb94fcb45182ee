"""`make test` (two workers) relies on tests/conftest.py grouping the tests for pytest-xdist's
loadgroup scheduler: one group for the shared Triton server, one per other module. xdist reads
the groups into the node ids in its own collection hook, so ours must run first; when it did
not, every worker started a shared server of its own and two workers wrote one module's probe
file at once. A one-worker run shows the group in each node id."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_xdist_run_sees_the_module_groups():
    module = "tests/project/test_layering.py"
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                          f"{module}::test_every_package_states_its_rule_in_two_lines"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"test_every_package_states_its_rule_in_two_lines@{module} " in run.stdout, run.stdout[-3000:]
