# Sourced by run_interop.sh and bench_karmada.sh: starts `dramesh demo --serve` (three replicas
# and three folder agents over real QUIC, every listener on a port the OS picks) from the binary
# cargo builds (found through its build messages, so CARGO_TARGET_DIR is honoured), waits until
# it serves, and sets:
#   work        a temporary folder, removed at exit with the demo stopped
#   bin         the dramesh binary
#   grpc_addrs  the replicas' gRPC addresses, one per line
#   fleet       the fleet folder the demo's agents publish (one folder per member cluster)
# With demo_tls=1 set before the call, the APIs serve TLS with certificates `dramesh certs` writes
# into $work/tls (ca.crt, api-server.crt/.key, api-client-interop.crt/.key), and only clients
# with a client certificate of that CA are answered.
# Usage: start_demo [--release]
start_demo() {
  bin="$(python3 tests/python/find_dramesh.py "$@")"
  work="$(mktemp -d)"
  server=""
  trap 'if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
  local tls_args=()
  if [ "${demo_tls:-0}" = 1 ]; then
    "$bin" certs --out "$work/tls" --api-server 127.0.0.1 --api-server localhost \
      --api-client interop >/dev/null
    tls_args=(--api-cert "$work/tls/api-server.crt" --api-key "$work/tls/api-server.key"
      --api-client-ca "$work/tls/ca.crt")
  fi
  "$bin" demo --serve "${tls_args[@]}" >"$work/demo.out" 2>"$work/demo.err" &
  server=$!
  # One "replica rN: HTTP ... gRPC ADDR ..." line per replica once converged, then the folder.
  local _
  for _ in $(seq 1 1200); do
    grep -q "agents poll" "$work/demo.out" && break
    if ! kill -0 "$server" 2>/dev/null; then
      echo "dramesh demo --serve exited early:" >&2; cat "$work/demo.out" "$work/demo.err" >&2; return 1
    fi
    sleep 0.1
  done
  if ! grep -q "agents poll" "$work/demo.out"; then
    echo "dramesh demo --serve did not start serving within 120 s:" >&2; cat "$work/demo.out" "$work/demo.err" >&2; return 1
  fi
  grpc_addrs="$(sed -n 's/.*replica r[0-9]*: HTTP .* gRPC \([0-9.:]*\) .*/\1/p' "$work/demo.out")"
  fleet="$(sed -n 's/.*agents poll \(.*\): edit a file.*/\1/p' "$work/demo.out")"
  if [ -z "$grpc_addrs" ] || [ ! -d "$fleet" ]; then
    echo "cannot read the demo's addresses:" >&2; cat "$work/demo.out" >&2; return 1
  fi
}
