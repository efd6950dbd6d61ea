//! The workload CA's side of the pod contract: where the operator puts the
//! CA's address, the projected token and the trust bundle, and the names the
//! agent reads them by. The CA (remora-operator) and the agent agree on these
//! and on nothing else.

/// The CA's gRPC port on the operator's Service (Istio's `istiod:15012`).
pub const PORT: u16 = 15012;
/// The Service port's name.
pub const PORT_NAME: &str = "grpc-ca";

/// The audience the pod's projected service-account token is minted for. The
/// CA accepts no other, so a token meant for the API server (or anything
/// else) cannot be replayed to it.
pub const TOKEN_AUDIENCE: &str = "remora-ca";
/// The projected token volume, its mount directory and file.
pub const TOKEN_VOLUME: &str = "remora-token";
pub const TOKEN_DIR: &str = "/var/run/secrets/tokens";
pub const TOKEN_FILE: &str = "remora-token";
/// [`TOKEN_DIR`]/[`TOKEN_FILE`], the agent's default `--token-path`.
pub const TOKEN_PATH: &str = "/var/run/secrets/tokens/remora-token";
/// The projected token's lifetime: the kubelet renews it at 80%.
pub const TOKEN_EXPIRATION_SECONDS: i64 = 3600;

/// The ConfigMap that carries the trust bundle (every root the mesh trusts,
/// old and new during a rotation) in every injected namespace. Anyone who
/// may write ConfigMaps in the namespace can edit it, so the sidecar uses it
/// only to check the CA's own certificate and as a hint to ask the CA again;
/// the roots it trusts for its peers come from [`TRUST_BUNDLE_METADATA`].
pub const TRUST_BUNDLE_CONFIGMAP: &str = "remora-ca-root-cert";
/// Its key: PEM, one or more roots.
pub const TRUST_BUNDLE_KEY: &str = "root-cert.pem";
/// The ConfigMap volume in the pod and where it is mounted.
pub const TRUST_BUNDLE_VOLUME: &str = "remora-ca-root";
pub const TRUST_BUNDLE_DIR: &str = "/etc/remora/ca";
/// [`TRUST_BUNDLE_DIR`]/[`TRUST_BUNDLE_KEY`]: the agent's `--ca-root-cert`.
pub const TRUST_BUNDLE_PATH: &str = "/etc/remora/ca/root-cert.pem";

/// The gRPC response metadata (binary: tonic base64-encodes it) in which the
/// CA returns, with every certificate it issues, every root the mesh trusts
/// now (current, staged and retiring; PEM). It reaches the sidecar over the
/// CA's verified connection, so a tenant who can write the
/// [`TRUST_BUNDLE_CONFIGMAP`] cannot add to it: the sidecar's peers are
/// checked against these roots alone. Istio clients ignore it.
pub const TRUST_BUNDLE_METADATA: &str = "x-remora-trust-bundle-bin";
/// The most the agent reads of [`TRUST_BUNDLE_METADATA`] (three P-256 roots
/// are about 2 KiB).
pub const MAX_TRUST_BUNDLE_BYTES: usize = 64 * 1024;

/// The Secret (in the operator's namespace) that holds the CA's signing roots.
pub const SIGNING_SECRET: &str = "remora-workload-ca";

/// `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`: the only
/// identity the CA signs for a token of that service account.
pub fn spiffe_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_agree() {
        assert_eq!(format!("{TOKEN_DIR}/{TOKEN_FILE}"), TOKEN_PATH);
        assert_eq!(
            format!("{TRUST_BUNDLE_DIR}/{TRUST_BUNDLE_KEY}"),
            TRUST_BUNDLE_PATH
        );
        assert_eq!(
            spiffe_id("cluster.local", "web", "default"),
            "spiffe://cluster.local/ns/web/sa/default"
        );
    }
}
