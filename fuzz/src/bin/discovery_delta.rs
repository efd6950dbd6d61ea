//! AFL++ harness for [`remora_fuzz::discovery_delta::discovery_delta`]; see scripts/fuzz.sh.

fn main() {
    // Built before the loop: once per process, so not a path AFL sees
    // appear in one run and not the next.
    remora_fuzz::discovery::world();
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::discovery_delta::discovery_delta(data);
    });
}
