//! The `remora-operator` command line: exit codes and output.

use std::io::Write;
use std::process::{Command, Stdio};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_remora-operator"))
}

fn run_stdin(args: &[&str], input: &str) -> anyhow::Result<std::process::Output> {
    let mut child = bin()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes())?;
    }
    Ok(child.wait_with_output()?)
}

#[test]
fn crds_prints_the_committed_yaml() -> anyhow::Result<()> {
    let out = bin().arg("crds").output()?;
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout)?, remora_crds::crd_yaml()?);
    Ok(())
}

#[test]
fn inject_from_stdin() -> anyhow::Result<()> {
    let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers: [{name: app, image: a}]\n";
    let out = run_stdin(&["inject", "-f", "-", "--mode", "Legacy"], pod)?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    assert!(text.contains("name: remora-proxy"), "{text}");
    Ok(())
}

#[test]
fn invalid_yaml_exits_1_naming_the_document() -> anyhow::Result<()> {
    let out = run_stdin(
        &["inject", "-f", "-"],
        "kind: ConfigMap\n---\nkind: Pod\nspec: [oops\n",
    )?;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr)?;
    assert!(err.contains("document 1"), "{err}");
    Ok(())
}

#[test]
fn bad_flags_exit_2_naming_the_flag() -> anyhow::Result<()> {
    let out = bin()
        .args(["inject", "-f", "-", "--mode", "Sideways"])
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr)?.contains("--mode"));
    let out = bin().args(["inject", "--no-such-flag"]).output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8(out.stderr)?.contains("--no-such-flag"));
    Ok(())
}

#[test]
fn bad_certificate_lifetimes_exit_2_naming_the_flag() -> anyhow::Result<()> {
    let cases: &[(&[&str], &str)] = &[
        (&["--ca-validity", "0s"], "--ca-validity"),
        (&["--ca-validity", "99999999d"], "--ca-validity"),
        (
            &["--serving-cert-validity", "5s"],
            "--serving-cert-validity",
        ),
        // Each fine alone, not together: checked before any API call.
        (
            &["--ca-validity", "60s", "--serving-cert-validity", "90s"],
            "--ca-validity",
        ),
        (
            &[
                "--serving-cert-validity",
                "30s",
                "--tls-secret-resync",
                "10s",
            ],
            "--tls-secret-resync",
        ),
    ];
    for (args, flag) in cases {
        let out = bin()
            .args(["serve", "--self-signed"])
            .args(*args)
            .env("KUBECONFIG", "/nonexistent")
            .output()?;
        let err = String::from_utf8(out.stderr)?;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
    }
    Ok(())
}

#[test]
fn missing_file_exits_1() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = bin()
        .args(["inject", "-f"])
        .arg(dir.path().join("absent.yaml"))
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    Ok(())
}
