//! What the agent makes of a CA's answer: the validated bundle it serves,
//! and (`--output-certs`) the same as files for the app containers.

use std::path::Path;
use std::time::SystemTime;

use super::ca_client::CaError;
use super::{CertBundle, CertError, union_roots, validate_bundle};

/// Turn a CA answer into a validated bundle: the last element of a longer
/// chain is the CA's root; the roots are it plus `trust_roots` (what the CA
/// said over its verified connection), each once. A one-element answer
/// carries no root: `trust_roots`, or the element itself.
pub fn bundle_from_chain(
    chain: Vec<String>,
    key_pem: String,
    trust_roots: Option<&str>,
) -> Result<CertBundle, CertError> {
    let mut parts: Vec<String> = chain
        .into_iter()
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())
        .collect();
    let chain_root = match (parts.len(), trust_roots) {
        (0, _) => return Err(CaError::EmptyChain.into()),
        (1, Some(_)) => None,
        (1, None) => Some(parts[0].clone()),
        _ => parts.pop(),
    };
    let roots_pem = union_roots(
        "root certificates",
        trust_roots.into_iter().chain(chain_root.as_deref()),
    )?;
    let chain_pem = parts.join("\n") + "\n";
    validate_bundle(chain_pem, key_pem, roots_pem, SystemTime::now())
}

/// Write the bundle as files for apps, each one atomically (temp + rename).
pub fn write_output(dir: &Path, b: &CertBundle) -> Result<(), CertError> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let werr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CertError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(werr(dir))?;
    for (name, content, mode) in [
        (super::CERT_CHAIN_FILE, &b.chain_pem, 0o644),
        (super::KEY_FILE, &b.key_pem, 0o600),
        (super::ROOT_CERT_FILE, &b.roots_pem, 0o644),
    ] {
        let path = dir.join(name);
        // NamedTempFile starts at 0600, so the key is never readable by others.
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(werr(dir))?;
        tmp.write_all(content.as_bytes()).map_err(werr(&path))?;
        tmp.as_file().sync_all().map_err(werr(&path))?;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(mode))
            .map_err(werr(&path))?;
        tmp.persist(&path).map_err(|e| CertError::Write {
            path: path.clone(),
            source: e.error,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::ca_client::Issuer;
    use super::super::testing::{ders, fake_ca, ident};
    use super::*;
    use remora_test_support::pki::Ca;

    /// ROOTCA is the trust bundle's roots plus the CA's chain root, each once.
    #[test]
    fn roots_are_the_union_of_the_trust_bundle_and_the_chain_root() {
        let ca = fake_ca(Duration::from_secs(1000));
        let old = Ca::new("old root");
        let (key, csr) = ident().key_and_csr().expect("csr");
        let leaf = ca
            .root
            .sign_csr(&csr, Duration::from_secs(600), &[])
            .expect("sign");
        let chain = vec![leaf.clone(), ca.root.pem.clone()];
        let key_pem = key.serialize_pem();
        let both = format!("{}{}", old.pem, ca.root.pem);
        for trust in [old.pem.clone(), both.clone()] {
            let b =
                bundle_from_chain(chain.clone(), key_pem.clone(), Some(&trust)).expect("bundle");
            assert_eq!(ders(&b.roots_pem), ders(&both), "{trust}");
            assert_eq!(
                ders(&b.chain_pem),
                ders(&leaf),
                "the root is not in the chain"
            );
        }
        // No trust bundle: the chain's root alone.
        let b = bundle_from_chain(chain.clone(), key_pem.clone(), None).expect("bundle");
        assert_eq!(ders(&b.roots_pem), ders(&ca.root.pem));
        // A chain of one carries no root: the trust bundle alone.
        let b = bundle_from_chain(vec![leaf], key_pem, Some(&old.pem)).expect("bundle");
        assert_eq!(ders(&b.roots_pem), ders(&old.pem));
    }

    #[test]
    fn chain_split_and_output_files() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let ca = fake_ca(Duration::from_secs(1000));
        let (key, csr) = ident().key_and_csr().expect("csr");
        let chain = rt
            .block_on(ca.issue(csr, Duration::from_secs(1)))
            .expect("issue")
            .chain;
        let b = bundle_from_chain(chain, key.serialize_pem(), None).expect("bundle");
        assert_eq!(b.roots_pem.trim(), ca.root.pem.trim());
        assert!(bundle_from_chain(vec![], String::new(), None).is_err());
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = tmp.path().join("out");
        write_output(&dir, &b).expect("write");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("key.pem"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let loaded = super::super::file::load_dir(&dir).expect("reload");
        assert_eq!(loaded, b);
    }
}
