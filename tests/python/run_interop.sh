#!/usr/bin/env bash
# Runs the Python Karmada-client interop test against examples/fake_estimator.rs.
# Needs the packages in requirements.txt (pip install -r tests/python/requirements.txt).
# Usage: tests/python/run_interop.sh [PORT]   (default 18352)
set -euo pipefail
cd "$(dirname "$0")/../.."
port="${1:-18352}"
cargo build -q -p dramesh-api --example fake_estimator
./target/debug/examples/fake_estimator "127.0.0.1:${port}" &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
python3 tests/python/karmada_client.py --address "127.0.0.1:${port}" --cluster member-1 --expected 32
