//! Generates the Karmada estimator and native dramesh.v1 message and service code from
//! `proto/` with the pure-Rust `protox` compiler, so building needs no system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto = manifest.join("../../proto");
    let karmada_root = proto.join("karmada");
    let files = [
        karmada_root.join("pkg/estimator/service/service.proto"),
        karmada_root.join("pkg/estimator/pb/estimator.proto"),
        karmada_root.join("k8s/api/core/v1/generated.proto"),
        karmada_root.join("k8s/apimachinery/pkg/api/resource/generated.proto"),
        proto.join("dramesh/v1/api.proto"),
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let fds = protox::compile(&files, [&karmada_root, &proto])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Clients stay generic over the transport so this crate needs no client stack.
        .build_transport(false)
        // Undecodable messages are INVALID_ARGUMENT, not INTERNAL (see src/codec.rs).
        .codec_path("crate::codec::ApiCodec")
        .compile_fds(fds)?;
    Ok(())
}
