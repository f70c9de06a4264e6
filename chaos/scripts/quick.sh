#!/usr/bin/env bash
# Runs the chaos quick profile (< 3 min) as CI does. Needs root, iproute2, iptables and
# faketime (apt-get install -y iproute2 iptables faketime). Extra arguments go to `run`.
# Binaries and results are in cargo's target directory (CARGO_TARGET_DIR is honoured).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --locked -p dramesh -p dramesh-chaos
target="$(scripts/target-dir)"
bin="$target/debug/dramesh-chaos"
"$bin" cleanup
trap '"$bin" cleanup >/dev/null 2>&1 || true' EXIT
"$bin" run --profile quick --dramesh "$target/debug/dramesh" --out "$target/chaos/quick" "$@"
