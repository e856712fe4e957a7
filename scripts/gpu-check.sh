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

# 5. The gateway under load on the GPU: two tiers contending on one
# replica of the 8B model, batch work flooding, interactive work arriving
# one at a time; TTFT per tier as clients see it (curl, streaming).
step "kiln serve --backend cuda: two tiers contending"
cat >"$work/gw.kiln" <<'KILN'
pool gpu {
  gpus 1
  kind "H200"
  memory 141GB
}

model llama-8b {
  params 8B
  kv_per_token 128KB
  variant bf16 { precision bf16 memory 20GB pools [gpu] max_batch 64 }
}

tier interactive {
  priority 100
  slo { ttft 2s }
  preempts [batch]
}

tier batch {
  priority 10
  slo { window 1h }
  preemptible
}

tenant chat {
  owner "gpu-check@example.com"
  tiers [interactive]
  api_keys ["key-chat"]
}

tenant bulk {
  owner "gpu-check@example.com"
  tiers [batch]
  api_keys ["key-bulk"]
}

classify {
  when tenant == chat => tier interactive
  default => tier batch
}

route [interactive, batch] llama-8b {
  default => bf16 on gpu
}
KILN
cal_arg=()
[ -f "$work/llama-8b.toml" ] && cal_arg=(--config "$work/gw.toml") && printf '[sim]\ncalibration = "%s"\n' "$work/llama-8b.toml" >"$work/gw.toml"
port=18193
"$kiln" serve --policy "$work/gw.kiln" --backend cuda --listen "127.0.0.1:$port" "${cal_arg[@]}" \
  >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  kill -0 "$serve_pid" 2>/dev/null || break
  sleep 0.5
done
if ! curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1; then
  echo "kiln serve did not start:"; cat "$work/serve.log"; status=1
else
  ask() { # tenant-key max_tokens -> "ttft_s total_s"
    curl -s -o /dev/null -m 120 -w '%{time_starttransfer} %{time_total}\n' \
      "http://127.0.0.1:$port/v1/chat/completions" -H "Authorization: Bearer $1" \
      -H 'content-type: application/json' \
      -d "{\"model\":\"llama-8b\",\"stream\":true,\"max_tokens\":$2,\"messages\":[{\"role\":\"user\",\"content\":\"$(printf 'lorem ipsum %.0s' $(seq 1 200))\"}]}"
  }
  : >"$work/batch.t"; : >"$work/chat.t"
  for _ in $(seq 1 96); do ask key-bulk 256 >>"$work/batch.t" & done
  sleep 1
  for _ in $(seq 1 16); do ask key-chat 32 >>"$work/chat.t"; done
  wait_deadline=$((SECONDS + 180))
  while [ "$(wc -l <"$work/batch.t")" -lt 96 ] && [ "$SECONDS" -lt "$wait_deadline" ]; do sleep 1; done
  summary() { sort -n "$1" | awk -v t="$2" '{a[NR]=$1; s+=$2} END {if (NR==0) {print t": no answers"; exit}
    printf "%-12s %4d requests   TTFT p50 %7.3f s   p95 %7.3f s   mean e2e %7.3f s\n", t, NR, a[int((NR+1)/2)], a[int(NR*0.95+0.999)], s/NR}'; }
  summary "$work/chat.t" interactive
  summary "$work/batch.t" batch
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^kiln_preemptions_total|^kiln_requests_total' | head -20
  kill -TERM "$serve_pid" 2>/dev/null || true
  wait "$serve_pid" 2>/dev/null || true
fi

exit "$status"
