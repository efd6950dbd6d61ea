//! The certificates and keys a local control plane needs, generated fresh for
//! each run (as envtest does), so nothing secret lives in the repository.

use std::path::{Path, PathBuf};

use remora_test_support::pki::{Ca, new_key};

use super::Error;

/// Paths of the PEM files written by [`Pki::write`].
#[derive(Debug, Clone)]
pub struct PkiFiles {
    /// CA that signs the serving cert and every client cert; also the
    /// API server's `--client-ca-file`.
    pub ca_cert: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    /// Public half for `--service-account-key-file`.
    pub sa_pub: PathBuf,
    /// Private half for `--service-account-signing-key-file`.
    pub sa_key: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
    pub kcm_cert: PathBuf,
    pub kcm_key: PathBuf,
}

/// Generates the CA, the API server's serving cert (127.0.0.1 and localhost),
/// the service-account signing key, and client certs for the test admin and
/// the controller manager, and writes them as PEM files under `dir`.
pub fn write(dir: &Path) -> Result<PkiFiles, Error> {
    let ca = Ca::new("remora-e2e-ca");
    // Names a client may dial: the loopback address the harness uses, and the
    // in-cluster names, so a webhook or pod-side client can verify it too.
    let serving = ca
        .issue()
        .names(&[
            "127.0.0.1",
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "10.0.0.1",
        ])
        .common_name("kube-apiserver")
        .server_auth()
        .sign();

    let client = |cn: &str| {
        // system:masters is bound to cluster-admin by the bootstrap RBAC
        // policy, and bypasses authorization entirely.
        let leaf = ca
            .issue()
            .common_name(cn)
            .organization("system:masters")
            .client_auth()
            .sign();
        (leaf.chain, leaf.key)
    };
    let (admin_cert, admin_key) = client("remora-e2e-admin");
    // The controller manager gets admin rights too: without
    // --use-service-account-credentials every controller acts as it, and the
    // narrow system:kube-controller-manager role would not be enough.
    let (kcm_cert, kcm_key) = client("system:kube-controller-manager");

    // ECDSA P-256: the API server signs service-account tokens with ES256.
    let sa = new_key();

    let files = PkiFiles {
        ca_cert: dir.join("ca.crt"),
        serving_cert: dir.join("apiserver.crt"),
        serving_key: dir.join("apiserver.key"),
        sa_pub: dir.join("sa.pub"),
        sa_key: dir.join("sa.key"),
        admin_cert: dir.join("admin.crt"),
        admin_key: dir.join("admin.key"),
        kcm_cert: dir.join("kcm.crt"),
        kcm_key: dir.join("kcm.key"),
    };
    let writes = [
        (&files.ca_cert, ca.pem.clone()),
        (&files.serving_cert, serving.chain),
        (&files.serving_key, serving.key),
        (&files.sa_pub, sa.public_key_pem()),
        (&files.sa_key, sa.serialize_pem()),
        (&files.admin_cert, admin_cert),
        (&files.admin_key, admin_key),
        (&files.kcm_cert, kcm_cert),
        (&files.kcm_key, kcm_key),
    ];
    for (path, pem) in writes {
        std::fs::write(path, pem)
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    }
    Ok(files)
}
