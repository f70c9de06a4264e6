#!/usr/bin/env bash
# Karmada estimator latency through the Python grpcio client against a real replica of
# `dramesh demo --serve` (tests/python/demo.sh): 1,000 sequential calls, then 1,000 calls from 16
# concurrent clients (tests/python/bench_karmada.py). Method and figures: docs/performance.md.
# Usage: tests/python/bench_karmada.sh [--release] [bench_karmada.py options]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=()
if [ "${1:-}" = "--release" ]; then build=(--release); shift; fi
. tests/python/demo.sh
start_demo "${build[@]}"
addr="$(echo "$grpc_addrs" | head -n 1)"
echo "dramesh: $bin; replica gRPC $addr; $(nproc) CPUs; load $(cut -d' ' -f1-3 /proc/loadavg)"
python3 tests/python/bench_karmada.py --address "$addr" --cluster us-west-mig \
  --node-selector nvidia.com/gpu.present=true --affinity-exists topology.kubernetes.io/zone \
  --toleration nvidia.com/gpu "$@"
