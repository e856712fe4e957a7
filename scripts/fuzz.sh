#!/usr/bin/env bash
# Runs kiln's fuzz targets (cargo-fuzz, libFuzzer) seeded from the repo's
# own policies, traffic slices and request bodies.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET ...]
#   FUZZ_SEED=1 FUZZ_RUNS=SCALE scripts/fuzz.sh 0   # reproducible: fixed seed,
#                                                  # fixed runs (CI)
#
# Targets: policy (parse, compile, lint, fmt), policy_upload (compile and
# plan an uploaded policy), traffic (JSONL reader, Azure and Mooncake
# importers), openai_body (the request body and its token count). CI runs
# each for a few seconds; run it for hours before a release. A crash or a
# leak past the memory limit exits non-zero and leaves the input under
# fuzz/artifacts/TARGET/ (reproduce with `cargo fuzz run TARGET FILE`).
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-60}
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(policy policy_upload traffic openai_body)

if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
# cargo-fuzz passes nightly-only compiler flags; the stable toolchain takes
# them with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1

seed() {
  local dir=fuzz/corpus/$1
  mkdir -p "$dir"
  case $1 in
    policy | policy_upload)
      find policies examples -name '*.kiln' -exec cp {} "$dir"/ \;
      ;;
    traffic)
      head -n 50 examples/diff/traffic.jsonl >"$dir/kiln.jsonl"
      for f in ../shared/traces/*/*.csv ../shared/traces/*/*.jsonl; do
        [ -f "$f" ] && head -n 20 "$f" >"$dir/$(basename "$f")"
      done
      ;;
    openai_body)
      find examples/requests -name '*.json' -exec cp {} "$dir"/ \;
      printf '%s' '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}' >"$dir/chat.json"
      printf '%s' '{"model":"m","prompt":[1,2,3],"max_tokens":4}' >"$dir/tokens.json"
      ;;
  esac
}

# Runs per target for a reproducible run (FUZZ_RUNS scales them): about
# ten seconds each on a 2-core machine.
runs_of() {
  local base
  case $1 in
    policy | traffic) base=10000 ;;
    policy_upload) base=20000 ;;
    *) base=500000 ;;
  esac
  echo $((base * ${FUZZ_RUNS:-1}))
}

status=0
for t in "${targets[@]}"; do
  seed "$t"
  if [ -n "${FUZZ_SEED:-}" ]; then
    bound=(-seed="$FUZZ_SEED" -runs="$(runs_of "$t")")
    echo "== fuzz $t: seed $FUZZ_SEED, $(runs_of "$t") runs"
  else
    bound=(-max_total_time="$secs")
    echo "== fuzz $t for ${secs}s"
  fi
  if ! cargo fuzz run --sanitizer none "$t" "fuzz/corpus/$t" -- \
    "${bound[@]}" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
    -print_final_stats=1; then
    echo "fuzz target $t failed; the input is under fuzz/artifacts/$t/" >&2
    status=1
  fi
done
exit $status
