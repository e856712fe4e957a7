#!/usr/bin/env bash
# GPU check for kiln's CUDA backend: build with `--features cuda`, list the
# GPUs, calibrate the simulator on a real GPU (an 8B model that fits whole,
# and a 70B one whose bf16 workload runs scaled down), and print the table
# of measured vs simulated step times by batch size, then a summary of the
# simulator's held-back error.
#
#   scripts/gpu-check.sh            # builds target/release/kiln first
#   KILN_BIN=path/to/kiln scripts/gpu-check.sh   # a binary built elsewhere
#
# Fails fast (exit 2) on a machine without an NVIDIA driver, before building.
# Budget: under 8 minutes on one H200 (build ~2-3 min, the rest ~2 min).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "gpu-check: $*" >&2; exit 2; }
step() { echo; echo "== $*"; }

# 1. Is there a GPU and a driver at all? (seconds, before any build)
if ! { [ -e /dev/nvidiactl ] || command -v nvidia-smi >/dev/null 2>&1 \
       || ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; }; then
  die "no NVIDIA GPU or driver on this machine (no /dev/nvidiactl, nvidia-smi or libcuda.so); the CUDA backend cannot run here: use the sim or http backend"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv \
    || die "nvidia-smi failed: the driver is not usable"
fi
cublas_found() {
  ldconfig -p 2>/dev/null | grep -q 'libcublas\.so' && return 0
  local d dirs
  IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && compgen -G "$d/libcublas.so*" >/dev/null && return 0
  done
  return 1
}
if ! cublas_found; then
  echo "gpu-check: warning: libcublas.so not found by ldconfig or on LD_LIBRARY_PATH; kiln will say so if it cannot load it" >&2
fi

# 2. The binary.
kiln=${KILN_BIN:-target/release/kiln}
if [ -z "${KILN_BIN:-}" ]; then
  step "cargo build --release --features cuda"
  command -v cargo >/dev/null 2>&1 \
    || die "no cargo here: build on another machine and pass KILN_BIN=path/to/kiln"
  start=$SECONDS
  timeout 300 cargo build --release --features cuda \
    || die "build failed (a machine without network needs vendored crates, or KILN_BIN=path/to/kiln built elsewhere)"
  echo "built in $((SECONDS - start)) s"
fi
[ -x "$kiln" ] || die "$kiln is not an executable"

# 3. Inventory, and a pool check against it.
step "kiln gpus"
timeout 60 "$kiln" gpus

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/gpu.kiln" <<'KILN'
# The GPU check's policy: one GPU, an 8B and a 70B model.
pool gpu {
  gpus 1
  kind "H200"
  memory 141GB
}

model llama-8b {
  params 8B
  kv_per_token 128KB
  variant bf16 { precision bf16 memory 20GB pools [gpu] }
}

model llama-70b {
  params 70B
  kv_per_token 320KB
  variant int8 { precision int8 memory 80GB pools [gpu] }
}

tier interactive {
  priority 100
}

tenant check {
  owner "gpu-check@example.com"
  tiers [interactive]
}

classify {
  default => tier interactive
}

route interactive llama-8b {
  default => bf16 on gpu
}

route interactive llama-70b {
  default => int8 on gpu
}
KILN
"$kiln" check "$work/gpu.kiln" >/dev/null || die "the check's policy does not compile (see above)"
step "kiln gpus --policy gpu.kiln --pool gpu"
timeout 60 "$kiln" gpus --policy "$work/gpu.kiln" --pool gpu || echo "(the pool declares more than this GPU has: see above)"

# 4. Calibration on the GPU: the table of step times by batch size and the
#    simulator's error on held-back steps.
status=0
# llama-70b int8 runs as a bf16 workload (140 GB): scaled down to fit.
for mv in llama-8b:bf16 llama-70b:int8; do
  m=${mv%:*} v=${mv#*:}
  step "kiln calibrate --backend cuda --model $m --variant $v"
  start=$SECONDS
  timeout 240 "$kiln" calibrate --backend cuda --policy "$work/gpu.kiln" \
    --model "$m" --variant "$v" --out "$work/$m.toml" | tee "$work/$m.report" || rc=$?
  echo "($m.$v: $((SECONDS - start)) s, exit ${rc:-0})"
  if [ "${rc:-0}" -ne 0 ]; then status=$rc; fi
  unset rc
  if [ -s "$work/$m.toml" ]; then echo "-- $m.toml"; cat "$work/$m.toml"; fi
done

step "summary: the simulator's error on held-back steps after calibration"
for mv in llama-8b:bf16 llama-70b:int8; do
  m=${mv%:*}
  printf '%-16s %s\n' "$mv" \
    "$(grep -h '^held-back error' "$work/$m.report" 2>/dev/null || echo 'no result')"
  grep -h '^calibration:\|^note: scaled' "$work/$m.report" 2>/dev/null | sed 's/^/                 /' || true
done

# 5. The gateway under load on the GPU.
# TODO(cuda-gateway): once `kiln serve` can bind a pool to `backend = "cuda"`,
# run it here with two tiers contending (interactive preempting batch) and
# report TTFT and throughput per tier against `kiln simulate` with the
# calibration just written.

exit "$status"
