"""``actstore verify`` tells the store's faults (exit 1) from what the user must fix first:
a missing optional dependency is one ``error:`` line naming the extra (exit 2), not a
fault of the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actstore.testing import FormatCase, make_acts, make_batches, make_plan

SRC = Path(__file__).resolve().parents[1] / "src"

_WITHOUT = """
import sys
for name in ("pyarrow", "datasets"):  # as when not installed: their imports fail
    sys.modules[name] = None
sys.argv = ["actstore", "verify", sys.argv[1], "--no-progress"]
from actstore.cli import main
main()
"""


@pytest.mark.slow  # the real command, in a subprocess
def test_verify_without_an_optional_dependency_is_a_usage_error(tmp_path):
    plan = make_plan()
    case = FormatCase("saelens")
    store = case.write(tmp_path / "s", plan, make_batches(plan, make_acts(plan)))
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT, str(store)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: 'datasets' is not installed; install it with `pip install 'actstore[datasets]'`"
    )
