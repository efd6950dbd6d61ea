//! Link options of the agent's binary.
//!
//! Packed relative relocations (DT_RELR, glibc >= 2.36): the loader reads
//! the whole relocation table at every start, so in the default RELA form
//! (24 bytes per pointer into the binary, ~270 KiB) it stays resident for
//! the agent's life; packed, it is a few KiB. Only for glibc targets: the
//! image's static musl build links its own way.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") == "linux" && var("CARGO_CFG_TARGET_ENV") == "gnu" {
        println!("cargo:rustc-link-arg-bin=remora-agent=-Wl,-z,pack-relative-relocs");
    }
}
