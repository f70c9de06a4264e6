#!/usr/bin/env bash
# Karmada gRPC interop against a real replica: starts `dramesh demo --serve` (tests/python/demo.sh:
# three replicas and three folder agents over real QUIC, on ports the OS picks), computes the
# expected answer offline with `dramesh estimate` on the demo's own fleet folder, then asks every
# replica with the Python grpcio client (tests/python/karmada_client.py) in the three Karmada wire
# styles. The demo serves TLS (demo_tls=1 in tests/python/demo.sh): the client calls with the CA
# and a client certificate, as karmada-scheduler with --scheduler-estimator-ca-file/-cert-file/
# -key-file does; the same client without a certificate must be refused (UNAUTHENTICATED), and a
# plaintext one must not be answered. Needs the packages in requirements.txt
# (pip install -r tests/python/requirements.txt).
# Usage: tests/python/run_interop.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/python/demo.sh
demo_tls=1
start_demo
tls="$work/tls"

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
ask=(--cluster "$cluster" --expected "$expected" --node-selector nvidia.com/gpu.present=true
  --affinity-exists topology.kubernetes.io/zone --toleration nvidia.com/gpu)
for addr in $grpc_addrs; do
  echo "-- replica at $addr (TLS, client certificate)"
  python3 tests/python/karmada_client.py --address "$addr" "${ask[@]}" \
    --ca "$tls/ca.crt" --cert "$tls/api-client-interop.crt" --key "$tls/api-client-interop.key"
done
addr="$(echo "$grpc_addrs" | head -n 1)"
echo "-- replica at $addr (TLS, no client certificate: refused)"
python3 tests/python/karmada_client.py --address "$addr" "${ask[@]}" --ca "$tls/ca.crt" \
  --expect-code UNAUTHENTICATED
echo "-- replica at $addr (plaintext: not answered)"
if python3 tests/python/karmada_client.py --address "$addr" "${ask[@]}" --timeout 3 \
  >"$work/plain.out" 2>&1; then
  echo "FAIL: a plaintext client was answered by a TLS listener" >&2; cat "$work/plain.out" >&2; exit 1
fi
echo "OK: plaintext refused"
