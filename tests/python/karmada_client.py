#!/usr/bin/env python3
"""Interop test: a Karmada-style estimator client that is not part of dramesh.

Generates Python gRPC stubs from the schema in proto/karmada at run time (grpcio-tools bundles
protoc), connects to a dramesh replica (or examples/fake_estimator.rs), and calls
MaxAvailableReplicas with the same requirements encoded three ways:

  v1.17  embedded Kubernetes messages only (resourceRequest, nodeAffinity, tolerations)
  v1.18  both the embedded messages and the *Bytes fields (Karmada v1.18 dual-writes)
  v1.19  *Bytes fields only (resourceRequestBytes, nodeAffinityBytes, tolerationsBytes)

The *Bytes values are produced by this client's own protobuf library from the Kubernetes
messages, as Karmada produces them with gogo's Marshal(). Exits 0 only if every answer equals
--expected; with --unknown-cluster, also checks that an unknown cluster is answered with 0
rather than an error.

tests/python/run_interop.sh runs it against a real replica (`dramesh demo --serve`), with the
expected answer computed offline by `dramesh estimate` on the same fleet. Example against the
fake estimator, whose member-1 fits 32 replicas of the default requirements:
  cargo run -p dramesh-api --example fake_estimator -- 127.0.0.1:10352 &
  python3 tests/python/karmada_client.py --address 127.0.0.1:10352 --cluster member-1 --expected 32
"""

import argparse
import importlib
import os
import subprocess
import sys
import tempfile

PROTO_FILES = [
    "pkg/estimator/service/service.proto",
    "pkg/estimator/pb/estimator.proto",
    "k8s/api/core/v1/generated.proto",
    "k8s/apimachinery/pkg/api/resource/generated.proto",
]


def generate_stubs(proto_root, out_dir):
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    subprocess.run(cmd, check=True)
    # Regular packages, so that an unrelated installed "k8s" or "pkg" package cannot shadow them.
    for dirpath, _dirs, _files in os.walk(out_dir):
        if dirpath != out_dir:
            open(os.path.join(dirpath, "__init__.py"), "a").close()
    sys.path.insert(0, out_dir)


def build_requests(pb, core, res, args):
    requests = {"cpu": args.cpu, "memory": args.memory}
    affinity = core.NodeSelector()
    term = affinity.nodeSelectorTerms.add()
    if args.affinity_exists:
        term.matchExpressions.add(key=args.affinity_exists, operator="Exists")
    else:
        key, _, values = args.affinity.partition("=")
        term.matchExpressions.add(key=key, operator="In", values=values.split(","))
    tolerations = [core.Toleration(key=args.toleration, operator="Exists", effect="NoSchedule")]
    key, _, value = args.node_selector.partition("=")
    node_selector = {key: value}

    def request(legacy, as_bytes):
        claim = pb.NodeClaim(nodeSelector=node_selector)
        rr = pb.ReplicaRequirements(nodeClaim=claim, namespace="default")
        if legacy:
            rr.nodeClaim.nodeAffinity.CopyFrom(affinity)
            rr.nodeClaim.tolerations.extend(tolerations)
            for name, q in requests.items():
                rr.resourceRequest[name].CopyFrom(res.Quantity(string=q))
        if as_bytes:
            rr.nodeClaim.nodeAffinityBytes = affinity.SerializeToString()
            rr.nodeClaim.tolerationsBytes.extend(t.SerializeToString() for t in tolerations)
            for name, q in requests.items():
                rr.resourceRequestBytes[name] = res.Quantity(string=q).SerializeToString()
        return pb.MaxAvailableReplicasRequest(cluster=args.cluster, replicaRequirements=rr)

    return {
        "v1.17": request(legacy=True, as_bytes=False),
        "v1.18": request(legacy=True, as_bytes=True),
        "v1.19": request(legacy=False, as_bytes=True),
    }


def default_proto_root():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "proto", "karmada"))


def main():
    default_root = default_proto_root()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="host:port of the estimator gRPC server")
    p.add_argument("--cluster", required=True, help="member cluster to ask about")
    p.add_argument("--expected", required=True, type=int, help="the answer every request style must get")
    p.add_argument("--cpu", default="500m")
    p.add_argument("--memory", default="1Gi")
    p.add_argument("--node-selector", default="zone=a", help="KEY=VALUE of the nodeSelector")
    p.add_argument("--affinity", default="gpu=h100",
                   help="KEY=V1,V2: one required node affinity term, KEY In (V1, V2)")
    p.add_argument("--affinity-exists", default="",
                   help="KEY: the affinity term is KEY Exists instead of --affinity")
    p.add_argument("--toleration", default="nvidia.com/gpu", help="KEY tolerated (Exists, NoSchedule)")
    p.add_argument("--unknown-cluster", default="no-such-cluster",
                   help="also ask about this cluster and require 0 (empty string to skip)")
    p.add_argument("--proto-root", default=default_root)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--ca", help="TLS: CA bundle the server certificate must chain to "
                   "(karmada-scheduler --scheduler-estimator-ca-file)")
    p.add_argument("--cert", help="TLS client certificate (--scheduler-estimator-cert-file)")
    p.add_argument("--key", help="its private key (--scheduler-estimator-key-file)")
    p.add_argument("--expect-code", default="",
                   help="instead of answers, require every call to fail with this gRPC status "
                        "code name (e.g. UNAUTHENTICATED)")
    args = p.parse_args()

    import grpc  # noqa: E402  (after argparse so --help works without grpcio)

    with tempfile.TemporaryDirectory(prefix="karmada-stubs-") as out:
        generate_stubs(args.proto_root, out)
        pb = importlib.import_module("pkg.estimator.pb.estimator_pb2")
        svc = importlib.import_module("pkg.estimator.service.service_pb2_grpc")
        core = importlib.import_module("k8s.api.core.v1.generated_pb2")
        res = importlib.import_module("k8s.apimachinery.pkg.api.resource.generated_pb2")

        # Kubernetes' Quantity encoding: the canonical string in field 1.
        assert res.Quantity(string="500m").SerializeToString() == b"\x0a\x04500m"

        failures = []
        answers = {}
        metadata = [("object", "kind=Deployment, name=default/interop")]
        if args.ca:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            creds = grpc.ssl_channel_credentials(
                root_certificates=read(args.ca),
                private_key=read(args.key) if args.key else None,
                certificate_chain=read(args.cert) if args.cert else None)
            channel = grpc.secure_channel(args.address, creds)
        else:
            channel = grpc.insecure_channel(args.address)
        with channel:
            grpc.channel_ready_future(channel).result(timeout=args.timeout)
            stub = svc.EstimatorStub(channel)
            for style, req in build_requests(pb, core, res, args).items():
                try:
                    r = stub.MaxAvailableReplicas(req, timeout=args.timeout, metadata=metadata)
                    if args.expect_code:
                        failures.append(f"{style}: answered {r.maxReplicas}, want {args.expect_code}")
                    else:
                        answers[style] = r.maxReplicas
                except grpc.RpcError as e:
                    if e.code().name != args.expect_code:
                        failures.append(f"{style}: RPC failed: {e.code()} {e.details()}")
                    else:
                        print(f"{style}: refused as expected: {e.code().name} {e.details()}")
            if args.expect_code:
                pass
            elif args.unknown_cluster:
                req = build_requests(pb, core, res, args)["v1.19"]
                req.cluster = args.unknown_cluster
                try:
                    r = stub.MaxAvailableReplicas(req, timeout=args.timeout, metadata=metadata)
                    if r.maxReplicas != 0:
                        failures.append(f"unknown cluster {args.unknown_cluster!r}: got {r.maxReplicas}, want 0")
                except grpc.RpcError as e:
                    failures.append(f"unknown cluster {args.unknown_cluster!r}: RPC failed instead of 0: {e.code()}")

    for style, n in answers.items():
        print(f"{style}: maxReplicas={n}")
        if n != args.expected:
            failures.append(f"{style}: got {n}, want {args.expected}")
    if len(set(answers.values())) > 1:
        failures.append(f"request styles disagree: {answers}")
    if failures:
        for f in failures:
            print("FAIL:", f, file=sys.stderr)
        return 1
    if args.expect_code:
        print(f"OK: every request style was refused with {args.expect_code}")
        return 0
    print(f"OK: all request styles answered {args.expected} for cluster {args.cluster!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
