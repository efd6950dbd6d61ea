//! mTLS between meshed workloads: what the discovery server puts in a
//! client's clusters and what the server's sidecar accepts agree on these.
//!
//! - The secrets a sidecar's Envoy fetches from its agent's SDS: its
//!   workload certificate and the roots it verifies peers with.
//! - The ALPN token only a Remora client offers when it originates the
//!   mesh's mTLS: the server's inbound listener terminates TLS only for a
//!   ClientHello carrying it, so an app's own TLS on that port is left alone.
//! - The Service annotation [`crate::annotations::IDENTITIES`]: the
//!   ServiceAccounts whose pods may serve the Service (secure naming).

use std::collections::BTreeSet;

/// The static cluster on which Envoy reaches its agent's SDS socket.
pub const SDS_CLUSTER: &str = "sds-grpc";
/// The SDS secret holding the workload certificate and key (Istio's name).
pub const WORKLOAD_SECRET: &str = "default";
/// The SDS secret holding the roots peers are verified with (Istio's name).
pub const ROOT_SECRET: &str = "ROOTCA";

/// The ALPN protocol a client's sidecar offers on the mesh's mTLS, and the
/// only one the server's inbound listener matches for it.
pub const MTLS_ALPN: &str = "remora-mtls";

/// Most ServiceAccounts one [`crate::annotations::IDENTITIES`] may name,
/// and its longest value: a longer one is refused, as any bad value.
pub const MAX_IDENTITIES: usize = 32;
pub const MAX_IDENTITIES_BYTES: usize = 4096;

/// The ServiceAccounts of [`crate::annotations::IDENTITIES`]
/// (`sa1,sa2`, names of the Service's namespace). A value that does not
/// parse is an error, never "any identity": the caller fails closed.
pub fn parse_identities(raw: &str) -> Result<BTreeSet<String>, String> {
    if raw.len() > MAX_IDENTITIES_BYTES {
        return Err(format!("longer than {MAX_IDENTITIES_BYTES} bytes"));
    }
    let mut out = BTreeSet::new();
    for item in raw.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        if !is_service_account_name(item) {
            return Err(format!(
                "{:?} is not a ServiceAccount name (a DNS subdomain: lowercase letters, digits, '-' and '.')",
                crate::mode::short(item)
            ));
        }
        out.insert(item.to_string());
    }
    if out.is_empty() {
        return Err("names no ServiceAccount".into());
    }
    if out.len() > MAX_IDENTITIES {
        return Err(format!("names more than {MAX_IDENTITIES} ServiceAccounts"));
    }
    Ok(out)
}

/// A DNS-1123 subdomain, what the API server accepts as a ServiceAccount's name.
fn is_service_account_name(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_service_account_names_or_an_error() {
        let ok = parse_identities(" cart, cart-v2 ,,cart").expect("parses");
        assert_eq!(ok.into_iter().collect::<Vec<_>>(), ["cart", "cart-v2"]);
        assert!(parse_identities("a.b-c").is_ok());
        for bad in [
            "",
            " , ",
            "Cart",
            "spiffe://cluster.local/ns/shop/sa/cart",
            "-a",
            "a..b",
            "a b",
            &"a".repeat(64),
        ] {
            assert!(parse_identities(bad).is_err(), "{bad:?} parsed");
        }
        let many: Vec<String> = (0..=MAX_IDENTITIES).map(|i| format!("sa{i}")).collect();
        assert!(parse_identities(&many.join(",")).is_err());
        assert!(parse_identities(&"a".repeat(MAX_IDENTITIES_BYTES + 1)).is_err());
    }
}
