//! Compile Istio's CA proto with protox (pure Rust, no protoc needed) and
//! generate tonic client + server stubs from the descriptor set.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/istio/security/ca.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
