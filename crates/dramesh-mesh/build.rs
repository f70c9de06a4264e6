//! Generates the wire envelope types from `proto/dramesh/mesh/v1/mesh.proto` with the
//! pure-Rust `protox` compiler, so building needs no system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest.join("../../proto");
    let file = proto_root.join("dramesh/mesh/v1/mesh.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&proto_root])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
