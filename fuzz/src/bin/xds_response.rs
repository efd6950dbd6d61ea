//! AFL++ harness for [`remora_fuzz::xds_proxy::xds_response`]; see scripts/fuzz.sh.

fn main() {
    afl::fuzz!(|data: &[u8]| {
        remora_fuzz::xds_proxy::xds_response(data);
    });
}
