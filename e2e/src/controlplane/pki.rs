//! The local control plane's certificates, kubeconfigs and component flags,
//! from the one implementation `scripts/cluster.sh` uses for the node:
//! `scripts/lib/controlplane.sh`, run with the profile `local`. Generated
//! fresh for each run (as envtest does), so nothing secret lives in the
//! repository.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::Error;

/// Where a local control plane listens and keeps its state.
#[derive(Debug, Clone)]
pub(super) struct Layout {
    pub dir: PathBuf,
    pub pki: PathBuf,
    pub port: u16,
    pub etcd_client: u16,
    pub etcd_peer: u16,
}

/// The Services' range of a local control plane (nothing routes it: there
/// is no node), and the `kubernetes` Service's address in it.
const SERVICE_CIDR: &str = "10.0.0.0/24";
const API_SERVICE_IP: &str = "10.0.0.1";

impl Layout {
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// `bash scripts/lib/controlplane.sh <function> [args]` with this
    /// layout's inputs; its stdout's lines.
    fn run(&self, function: &str, args: &[&Path]) -> Result<Vec<String>, Error> {
        let script = crate::node::repo_root().join("scripts/lib/controlplane.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg(function)
            .args(args)
            .env("CP_PROFILE", "local")
            .env("CP_DIR", &self.dir)
            .env("CP_PKI", &self.pki)
            .env("CP_BIND", "127.0.0.1")
            .env("CP_PORT", self.port.to_string())
            .env("CP_ETCD_CLIENT", format!("127.0.0.1:{}", self.etcd_client))
            .env("CP_ETCD_PEER", format!("127.0.0.1:{}", self.etcd_peer))
            .env("CP_SERVICE_CIDR", SERVICE_CIDR)
            .env("CP_API_SERVICE_IP", API_SERVICE_IP)
            .env("CP_ISSUER", self.url())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Error::io(format!("running {}", script.display()), e))?;
        if !out.status.success() {
            return Err(Error::Launcher {
                function: function.to_owned(),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }

    /// The CA, the API server's serving cert, the service-account key
    /// pair, and client certs for the test admin and the controller
    /// manager (both `system:masters`).
    pub fn write_pki(&self) -> Result<PkiFiles, Error> {
        self.run("pki", &[])?;
        let p = |name: &str| self.pki.join(name);
        Ok(PkiFiles {
            ca_cert: p("ca.crt"),
            serving_cert: p("apiserver.crt"),
            serving_key: p("apiserver.key"),
            sa_pub: p("sa.pub"),
            sa_key: p("sa.key"),
            admin_cert: p("admin.crt"),
            admin_key: p("admin.key"),
            kcm_cert: p("controller-manager.crt"),
            kcm_key: p("controller-manager.key"),
        })
    }

    /// A kubeconfig at `path` for the client cert `cert` (`admin`,
    /// `controller-manager`).
    pub fn write_kubeconfig(&self, path: &Path, cert: &str) -> Result<(), Error> {
        let url = self.url();
        self.run("kubeconfig", &[path, Path::new(&url), Path::new(cert)])
            .map(drop)
    }

    pub fn etcd_flags(&self) -> Result<Vec<String>, Error> {
        self.run("etcd_flags", &[])
    }

    pub fn apiserver_flags(&self) -> Result<Vec<String>, Error> {
        self.run("apiserver_flags", &[])
    }

    pub fn controller_manager_flags(&self, kubeconfig: &Path) -> Result<Vec<String>, Error> {
        self.run("controller_manager_flags", &[kubeconfig])
    }
}

/// Paths of the PEM files [`Layout::write_pki`] wrote.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dir: &Path) -> Layout {
        Layout {
            dir: dir.to_path_buf(),
            pki: dir.join("pki"),
            port: 40001,
            etcd_client: 40002,
            etcd_peer: 40003,
        }
    }

    #[test]
    fn the_local_profile_writes_what_its_flags_name() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let l = layout(tmp.path());
        let pki = l.write_pki().expect("pki");
        for f in [
            &pki.ca_cert,
            &pki.serving_cert,
            &pki.sa_key,
            &pki.admin_key,
            &pki.kcm_cert,
        ] {
            assert!(f.is_file(), "{} not written", f.display());
        }
        let api = l.apiserver_flags().expect("flags");
        for want in [
            "--secure-port=40001",
            "--etcd-servers=http://127.0.0.1:40002",
            "--authorization-mode=RBAC",
            "--endpoint-reconciler-type=none",
        ] {
            assert!(api.iter().any(|f| f == want), "{want} missing from {api:?}");
        }
        // Every file a flag names exists.
        for f in &api {
            if let Some((_, path)) = f.split_once("-file=") {
                assert!(Path::new(path).is_file(), "{f}: no such file");
            }
        }
        assert!(!api.iter().any(|f| f.contains("kubelet")), "{api:?}");
        let kc = tmp.path().join("kc");
        l.write_kubeconfig(&kc, "admin").expect("kubeconfig");
        let text = std::fs::read_to_string(&kc).expect("read");
        assert!(text.contains("server: https://127.0.0.1:40001"), "{text}");
        let kcm = l.controller_manager_flags(&kc).expect("kcm flags");
        assert!(kcm.iter().any(|f| f == "--secure-port=0"), "{kcm:?}");
        assert!(
            kcm.iter()
                .any(|f| f.starts_with("--controllers=job-controller")
                    || f.contains(",job-controller,")),
            "{kcm:?}"
        );
    }

    #[test]
    fn a_missing_input_is_an_error_naming_it() {
        let script = crate::node::repo_root().join("scripts/lib/controlplane.sh");
        let out = Command::new("bash")
            .arg(script)
            .arg("apiserver_flags")
            .env("CP_PROFILE", "local")
            .env_remove("CP_PORT")
            .output()
            .expect("bash");
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("CP_DIR is not set"));
    }
}
