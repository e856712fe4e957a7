#!/usr/bin/env bash
# Ingest over HTTP, one binary against another in the same run: for each
# round and each binary given, a fresh `kiln serve` (benches/batch.kiln,
# fresh store) gets FILE through `POST /v1/files` (curl, multipart) and
# then `POST /v1/batches`; prints upload, create and their total per run,
# and the load average. `cargo bench --bench batch` with
# BATCH_BENCH_INGEST=http does the same from Rust (KILN_BIN, KILN_BASE_BIN).
#
#   scripts/batch_ingest_http.sh FILE ROUNDS BIN...
set -euo pipefail
file=$1; rounds=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for r in $(seq "$rounds"); do
  for bin in "$@"; do
    rm -rf "$work/st"; mkdir "$work/st"
    "$bin" serve --policy "$root/benches/batch.kiln" --listen 127.0.0.1:0 --sim-speed 20 \
      --batch-store "$work/st/b.db" >/dev/null 2>"$work/st/err.log" &
    pid=$!
    addr=""
    for _ in $(seq 100); do
      addr=$(grep -o "127.0.0.1:[0-9]*" "$work/st/err.log" | head -1 || true)
      [ -n "$addr" ] && break
      sleep 0.1
    done
    sleep 0.3
    up=$(curl -s -o "$work/st/f.json" -w "%{http_code} %{time_total}" -H "authorization: Bearer k-bulk" \
      -F purpose=batch -F "file=@$file" "http://$addr/v1/files")
    fid=$(grep -o '"id":"file-[0-9a-f]*"' "$work/st/f.json" | cut -d'"' -f4)
    cr=$(curl -s -o "$work/st/b.json" -w "%{http_code} %{time_total}" -H "authorization: Bearer k-bulk" \
      -H "content-type: application/json" \
      -d "{\"input_file_id\":\"$fid\",\"endpoint\":\"/v1/chat/completions\",\"completion_window\":\"24h\"}" \
      "http://$addr/v1/batches")
    read -r ucode us <<<"$up"
    read -r ccode cs <<<"$cr"
    echo "round $r $(basename "$bin"): upload $ucode ${us} s, create $ccode ${cs} s, total $(echo "$us + $cs" | bc) s, load $(cut -d' ' -f1 /proc/loadavg)"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done
