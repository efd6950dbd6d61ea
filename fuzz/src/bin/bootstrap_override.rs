//! AFL++ harness for [`remora_fuzz::bootstrap_override`]; see scripts/fuzz.sh.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::bootstrap_override(data);
    });
}
