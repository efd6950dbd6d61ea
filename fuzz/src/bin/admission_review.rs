//! AFL++ harness for [`remora_fuzz::admission_review`]; see scripts/fuzz.sh.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::admission_review(data);
    });
}
