//! The requests a simulated Envoy sends on an ADS stream, state of the
//! world and delta: a subscription, or the ACK of a response (its version
//! and nonce echoed). The simulated proxies of the discovery benchmarks
//! (e2e's and the operator's) build theirs here.

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};

/// A state-of-the-world request for `type_url` naming `names` (none: a
/// wildcard), ACKing `ack` if given.
pub fn request(
    type_url: &str,
    names: Vec<String>,
    ack: Option<&DiscoveryResponse>,
) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: type_url.into(),
        resource_names: names,
        version_info: ack.map(|r| r.version_info.clone()).unwrap_or_default(),
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

/// A delta request for `type_url` subscribing to `subscribe`, ACKing `ack`
/// if given.
pub fn delta_request(
    type_url: &str,
    subscribe: Vec<String>,
    ack: Option<&DeltaDiscoveryResponse>,
) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: type_url.into(),
        resource_names_subscribe: subscribe,
        response_nonce: ack.map(|r| r.nonce.clone()).unwrap_or_default(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_echoes_the_version_and_nonce_a_subscription_does_not() {
        let resp = DiscoveryResponse {
            version_info: "v7".into(),
            nonce: "n3".into(),
            ..Default::default()
        };
        let ack = request("t", vec!["a".into()], Some(&resp));
        assert_eq!(
            (ack.version_info.as_str(), ack.response_nonce.as_str()),
            ("v7", "n3")
        );
        assert_eq!(ack.resource_names, ["a"]);
        let first = request("t", Vec::new(), None);
        assert!(first.version_info.is_empty() && first.response_nonce.is_empty());

        let delta = DeltaDiscoveryResponse {
            nonce: "d1".into(),
            ..Default::default()
        };
        let ack = delta_request("t", Vec::new(), Some(&delta));
        assert_eq!(ack.response_nonce, "d1");
        let sub = delta_request("t", vec!["c".into()], None);
        assert!(sub.response_nonce.is_empty());
        assert_eq!(sub.resource_names_subscribe, ["c"]);
    }
}
