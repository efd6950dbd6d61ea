//! AFL++ harness for [`remora_fuzz::contract_annotations`]; see scripts/fuzz.sh.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::contract_annotations(data);
    });
}
