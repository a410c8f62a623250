"""Every seeded bug in tests/mutation/catalog_*.py fails its tests (tools/mutants.py; run by CI).

``pytest -m mutation`` runs the harness over all catalogs; a mutant that survives, or that
cannot be applied or run, fails this test with the harness's table. The harness's own output
(one line per mutant as it finishes) goes to ``mutants.log`` in the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.mutation


@pytest.mark.skipif(bool(os.environ.get("MEGATRON_PRUNE_MUTANT_COPY")),
                    reason="already inside a mutant's copy: the harness does not run itself")
def test_every_mutant_is_killed(tmp_path):
    report, log = tmp_path / "mutants.json", tmp_path / "mutants.log"
    cmd = [sys.executable, str(REPO / "tools" / "mutants.py"), "--jobs", "2", "--timeout", "600",
           "--json", str(report)]
    with log.open("w") as out:
        harness = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            harness.wait(timeout=3600)
        except subprocess.TimeoutExpired:
            harness.terminate()  # the harness stops the test runs it started, then exits
            harness.wait(timeout=120)
            pytest.fail(f"the mutation harness ran over an hour:\n{log.read_text()[-6000:]}")
    output = log.read_text()
    assert report.exists(), f"the harness wrote no report (exit {harness.returncode}):\n{output[-8000:]}"
    results = json.loads(report.read_text())["results"]
    failed = [f"{r['name']} ({r['catalog']}): {r['status']}: {r['detail']}" for r in results
              if r["status"] in ("survived", "error")]
    assert not failed and harness.returncode == 0, (
        "mutants not killed:\n  " + "\n  ".join(failed) + f"\n\n{output[-8000:]}"
    )
