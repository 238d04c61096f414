#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for SECONDS each, one after another:
#   fuzz/run.sh SECONDS [TARGET...]
# Installs what it needs when missing: a nightly toolchain (cargo-fuzz builds with -Z flags) and
# cargo-fuzz. Targets are built with debug assertions and overflow checks (-a) and without a
# sanitizer (-s none): the code under test is safe Rust, so a sanitizer would only halve the rate.
# The corpus grows in fuzz/corpus/TARGET; a failing input lands in fuzz/artifacts/TARGET, and the
# script stops with the target's exit status.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${1:?usage: fuzz/run.sh SECONDS [TARGET...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(prepare disjoint partition expand)

if ! cargo +nightly --version >/dev/null 2>&1; then
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi

for t in "${targets[@]}"; do
  echo "== fuzz target $t: ${seconds}s"
  start=$(date +%s)
  log=$(mktemp)
  status=0
  cargo +nightly fuzz run -a -s none "$t" -- -max_total_time="$seconds" -print_final_stats=1 \
    >"$log" 2>&1 || status=$?
  grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)|DONE +cov:' "$log" || true
  echo "   exit $status after $(( $(date +%s) - start ))s"
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log"
    rm -f "$log"
    exit "$status"
  fi
  rm -f "$log"
done
