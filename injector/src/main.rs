//! remora-injector: filled in by the injector issue.
fn main() {
    println!("remora-injector {}", env!("CARGO_PKG_VERSION"));
}
