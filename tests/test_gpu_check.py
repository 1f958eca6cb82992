"""`benches/gpu_check.py --dry-run`: the GPU check's CPU side (argument parsing, preflight,
building the model the GPU machine will use, the CPU half of the end-to-end parity) runs here
and writes its record, so the one GPU run a task may get is not spent on a typo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_writes_the_record(tmp_path):
    sys.path.insert(0, str(ROOT / "benches"))
    import gpu_check

    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["finished"] and record["passed"]
    checks = {row["check"]: row for row in record["rows"]}
    assert checks["preflight: versions"]["result"] == "ok"
    half = checks["end to end: CPU half (fp32)"]
    assert (
        half["result"] == "dry"
        and "random Llama, SmolLM2's shape" in half["detail"]
        and "3 prompts x 32" in half["detail"]
    )
    log = (tmp_path / "gpu_check.log").read_text()
    assert "end to end: CPU half" in log and "preflight: versions" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the full run is make gpu-check's")
def test_without_a_gpu_the_full_run_says_so(tmp_path):
    sys.path.insert(0, str(ROOT / "benches"))
    import gpu_check

    assert gpu_check.main(["--out", str(tmp_path)]) == 2
