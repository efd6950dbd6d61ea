//! Compile Istio's CA proto and Remora's own messages with protox (pure
//! Rust, no protoc needed) and generate tonic client + server stubs from the
//! descriptor set.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/istio/security/ca.proto", "proto/remora/v1/pod.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        // Maps as BTreeMap: encoded in key order, so equal content encodes
        // to equal bytes (the discovery server's versions are digests).
        .btree_map(".")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
