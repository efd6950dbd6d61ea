//! AFL++ harness for [`remora_fuzz::injector_review`]; see scripts/fuzz.sh.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::injector_review(data);
    });
}
