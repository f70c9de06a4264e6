#!/usr/bin/env python3
"""Latency of Karmada MaxAvailableReplicas calls through the Python grpcio client.

Runs --calls sequential calls on one channel, then --calls calls spread over --clients threads
with one channel each (as many schedulers), after --warmup calls, and prints p50/p90/p99/max in
milliseconds and calls per second. Requests use the v1.19 wire style (*Bytes fields) with the
requirements of karmada_client.py's arguments. tests/python/bench_karmada.sh runs it against
`dramesh demo --serve`; docs/performance.md describes the method.
"""

import argparse
import importlib
import statistics
import sys
import tempfile
import threading
import time

import karmada_client


def percentile(sorted_ms, q):
    i = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[i]


def report(name, ms, wall):
    ms = sorted(ms)
    print(f"{name:<22} n={len(ms):5d}  p50={percentile(ms, .5):6.3f}  p90={percentile(ms, .9):6.3f}  "
          f"p99={percentile(ms, .99):6.3f}  max={ms[-1]:7.3f} ms  mean={statistics.fmean(ms):6.3f} ms  "
          f"{len(ms) / wall:8.0f} calls/s")
    return percentile(ms, .99)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--cpu", default="500m")
    p.add_argument("--memory", default="1Gi")
    p.add_argument("--node-selector", default="zone=a")
    p.add_argument("--affinity", default="gpu=h100")
    p.add_argument("--affinity-exists", default="")
    p.add_argument("--toleration", default="nvidia.com/gpu")
    p.add_argument("--proto-root", default=karmada_client.default_proto_root())
    args = p.parse_args()

    import grpc

    with tempfile.TemporaryDirectory(prefix="karmada-stubs-") as out:
        karmada_client.generate_stubs(args.proto_root, out)
        pb = importlib.import_module("pkg.estimator.pb.estimator_pb2")
        svc = importlib.import_module("pkg.estimator.service.service_pb2_grpc")
        core = importlib.import_module("k8s.api.core.v1.generated_pb2")
        res = importlib.import_module("k8s.apimachinery.pkg.api.resource.generated_pb2")
        req = karmada_client.build_requests(pb, core, res, args)["v1.19"]
        metadata = [("object", "kind=Deployment, name=default/bench")]

        def calls(stub, n, out_ms, answers):
            for _ in range(n):
                t = time.perf_counter()
                r = stub.MaxAvailableReplicas(req, timeout=10, metadata=metadata)
                out_ms.append((time.perf_counter() - t) * 1000)
                answers.add(r.maxReplicas)

        answers = set()
        with grpc.insecure_channel(args.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            stub = svc.EstimatorStub(ch)
            calls(stub, args.warmup, [], answers)
            seq = []
            t = time.perf_counter()
            calls(stub, args.calls, seq, answers)
            seq_wall = time.perf_counter() - t

        per = [args.calls // args.clients + (1 if i < args.calls % args.clients else 0)
               for i in range(args.clients)]
        conc = [[] for _ in per]
        channels = [grpc.insecure_channel(args.address) for _ in per]
        for ch in channels:
            grpc.channel_ready_future(ch).result(timeout=10)
            calls(svc.EstimatorStub(ch), 5, [], answers)
        start = threading.Barrier(len(per) + 1)

        def worker(i):
            stub = svc.EstimatorStub(channels[i])
            start.wait()
            calls(stub, per[i], conc[i], answers)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(per))]
        for th in threads:
            th.start()
        start.wait()
        t = time.perf_counter()
        for th in threads:
            th.join()
        conc_wall = time.perf_counter() - t
        for ch in channels:
            ch.close()

    print(f"cluster {args.cluster!r}: answers {sorted(answers)}")
    report("sequential", seq, seq_wall)
    report(f"concurrent ({args.clients} clients)", [x for c in conc for x in c], conc_wall)
    if len(answers) != 1 or 0 in answers:
        print(f"FAIL: expected one non-zero answer, got {sorted(answers)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
