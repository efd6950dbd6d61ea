//! AFL++ harness for [`remora_fuzz::sds_request`]; see scripts/fuzz.sh.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::sds_request(data);
    });
}
