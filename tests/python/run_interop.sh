#!/usr/bin/env bash
# Karmada gRPC interop against a real replica: starts `dramesh demo --serve` (tests/python/demo.sh:
# three replicas and three folder agents over real QUIC, on ports the OS picks), computes the
# expected answer offline with `dramesh estimate` on the demo's own fleet folder, then asks every
# replica with the Python grpcio client (tests/python/karmada_client.py) in the three Karmada wire
# styles. Needs the packages in requirements.txt (pip install -r tests/python/requirements.txt).
# Usage: tests/python/run_interop.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/python/demo.sh
start_demo

# The same requirements the client sends, as a workload for the offline estimate.
cat >"$work/workload.yaml" <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata: {name: interop, namespace: default}
spec:
  replicas: 1
  selector: {matchLabels: {app: interop}}
  template:
    metadata: {labels: {app: interop}}
    spec:
      nodeSelector: {nvidia.com/gpu.present: "true"}
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions:
              - {key: topology.kubernetes.io/zone, operator: Exists}
      tolerations:
      - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
      containers:
      - name: c
        image: x
        resources:
          requests: {cpu: 500m, memory: 1Gi}
YAML
"$bin" estimate --snapshot "$fleet" -w "$work/workload.yaml" -o json >"$work/estimate.json"
read -r cluster expected < <(python3 -c '
import json, sys
clusters = json.load(open(sys.argv[1]))["clusters"]
c = max(clusters, key=lambda c: c["maxReplicas"])
print(c["name"], c["maxReplicas"])' "$work/estimate.json")
if [ "$expected" -le 0 ]; then
  echo "the offline estimate fits no replica anywhere; the interop check would prove nothing" >&2; exit 1
fi
echo "offline estimate: $cluster fits $expected replicas"
for addr in $grpc_addrs; do
  echo "-- replica at $addr"
  python3 tests/python/karmada_client.py --address "$addr" --cluster "$cluster" --expected "$expected" \
    --node-selector nvidia.com/gpu.present=true --affinity-exists topology.kubernetes.io/zone \
    --toleration nvidia.com/gpu
done
