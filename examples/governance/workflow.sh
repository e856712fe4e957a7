#!/usr/bin/env bash
# The governance workflow end to end on one machine: a reviewed change is
# linted and diffed (what CI does on the pull request), proposed to a
# running gateway, approved by two signers, rolled out through shadow and
# canary to enforcement while traffic flows, an incident control is used,
# and the audit log is verified.
#
#   examples/governance/workflow.sh            # builds kiln if needed
#   KILN=target/release/kiln PORT=18181 examples/governance/workflow.sh
#
# Everything runs on 127.0.0.1 with simulated GPUs 60x faster than real
# time, so the policy's "shadow 10m" lasts 10 seconds and the whole script
# about a minute. It stops the gateway and removes its files when it ends.
set -euo pipefail
cd "$(dirname "$0")/../.."

KILN=${KILN:-target/debug/kiln}
PORT=${PORT:-18080}
SERVER=http://127.0.0.1:$PORT
[ -x "$KILN" ] || cargo build --quiet --bin kiln
command -v curl >/dev/null || { echo "this script needs curl" >&2; exit 2; }

work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "1. CI on the pull request: check, lint and diff the change"
"$KILN" check examples/governance/proposed
"$KILN" lint --deny warnings examples/governance/proposed
"$KILN" diff examples/governance/policy examples/governance/proposed

step "2. Keys for the approvers, tokens for the people"
for who in alice bob carol; do
  "$KILN" keygen --out "$work/$who" 2>/dev/null >/dev/null
done
token() { head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
ALICE=$(token) BOB=$(token) CAROL=$(token) ONCALL=$(token)
{
  echo "listen = \"127.0.0.1:$PORT\""
  for pair in "alice:$ALICE" "bob:$BOB" "carol:$CAROL" "oncall:$ONCALL"; do
    echo "[[admin.tokens]]"
    echo "name = \"${pair%%:*}\""
    echo "sha256 = \"$("$KILN" hash-key "${pair#*:}")\""
  done
  echo '[[approvers]]'
  echo 'name = "alice"'
  echo 'groups = ["platform"]'
  echo "public_key = \"$(cat "$work/alice.pub")\""
  echo '[[approvers]]'
  echo 'name = "bob"'
  echo 'groups = ["platform", "platform-leads"]'
  echo "public_key = \"$(cat "$work/bob.pub")\""
  echo '[[approvers]]'
  echo 'name = "carol"'
  echo 'groups = ["platform-leads"]'
  echo "public_key = \"$(cat "$work/carol.pub")\""
  echo '[governance]'
  echo 'watch = "10m"'
  echo 'window = "5m"'
  echo '[audit]'
  echo "path = \"$work/audit.jsonl\""
  echo '[log]'
  echo "path = \"$work/decisions.jsonl\""
} >"$work/kiln.toml"
echo "wrote $work/kiln.toml: 4 named admin tokens, 3 approvers"

step "3. The gateway serves the policy in force"
"$KILN" serve --policy examples/governance/policy --config "$work/kiln.toml" \
  --sim-speed 60 2>"$work/serve.log" &
server_pid=$!
for _ in $(seq 1 100); do
  curl -sf "$SERVER/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -sf "$SERVER/healthz" >/dev/null || { cat "$work/serve.log"; exit 1; }

# Bounded traffic from the three tenants; every failure is counted.
traffic() {
  local rounds=$1 failed=0
  for _ in $(seq 1 "$rounds"); do
    for key in key-support key-analytics key-evals; do
      code=$(curl -s -o /dev/null -w '%{http_code}' "$SERVER/v1/chat/completions" \
        -H "Authorization: Bearer $key" -H 'content-type: application/json' \
        -d '{"model": "llama-8b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}')
      [ "$code" = 200 ] || failed=$((failed + 1))
    done
    sleep 0.05
  done
  echo "traffic: $((rounds * 3)) requests, $failed not served"
}
traffic 20 # recorded in the decision log: the proposal's dry run replays it

step "4. alice proposes the reviewed change"
export KILN_SERVER=$SERVER
KILN_ADMIN_TOKEN=$ALICE "$KILN" propose examples/governance/proposed | tee "$work/proposal.txt"
id=$(sed -n 's/^proposal \(p-[0-9]*\) .*/\1/p' "$work/proposal.txt")

step "5. bob and carol approve it (the quota increase needs two platform leads)"
KILN_ADMIN_TOKEN=$BOB "$KILN" approve "$id" --key "$work/bob.key" >/dev/null
echo "bob approved; still missing:"
KILN_ADMIN_TOKEN=$ONCALL "$KILN" status | sed -n '/^proposals/,/^$/p'
echo "alice may not approve her own proposal:"
KILN_ADMIN_TOKEN=$ALICE "$KILN" approve "$id" --key "$work/alice.key" || true
KILN_ADMIN_TOKEN=$CAROL "$KILN" approve "$id" --key "$work/carol.key" >/dev/null
echo "carol approved: the rollout starts"

step "6. shadow -> canary -> enforce, with traffic flowing"
traffic 400 >"$work/traffic.txt" &
traffic_pid=$!
seen=
for _ in $(seq 1 120); do
  out=$(KILN_ADMIN_TOKEN=$ONCALL "$KILN" status)
  stage=$(echo "$out" | sed -n 's/^rollout   .*: \([a-z]*\) for .*/\1/p')
  if [ -n "$stage" ] && [ "$stage" != "$seen" ]; then
    echo "--- stage: $stage"
    echo "$out" | sed -n '/^rollout/,/^$/p'
    seen=$stage
  fi
  if echo "$out" | grep -q '^rollout   none' && [ -n "$seen" ]; then
    echo "--- done"
    break
  fi
  sleep 1
done
wait "$traffic_pid" || true
cat "$work/traffic.txt"
KILN_ADMIN_TOKEN=$ONCALL "$KILN" status

step "7. Incident: pause the batch tier for 30 minutes, then resume it"
KILN_ADMIN_TOKEN=$ONCALL "$KILN" pause tier batch --for 30m --reason "incident 7"
curl -s "$SERVER/v1/chat/completions" -H 'Authorization: Bearer key-analytics' \
  -H 'content-type: application/json' \
  -d '{"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
echo
KILN_ADMIN_TOKEN=$ONCALL "$KILN" status | sed -n '/^overrides/,$p'
KILN_ADMIN_TOKEN=$ONCALL "$KILN" resume tier batch

step "8. The audit log: every step above, hash-chained"
cut -c1-150 "$work/audit.jsonl" | sed 's/$/…/'
"$KILN" audit verify "$work/audit.jsonl"
