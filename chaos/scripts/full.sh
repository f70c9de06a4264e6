#!/usr/bin/env bash
# Runs every chaos scenario (about 10 minutes). Same needs as quick.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --locked --release -p dramesh -p dramesh-chaos
target="$(scripts/target-dir)"
bin="$target/release/dramesh-chaos"
"$bin" cleanup
trap '"$bin" cleanup >/dev/null 2>&1 || true' EXIT
"$bin" run --profile full --dramesh "$target/release/dramesh" --out "$target/chaos/full" "$@"
