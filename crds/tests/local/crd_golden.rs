//! The CRD YAML committed to the chart must be what the code generates.
//! Regenerate with `REMORA_BLESS=1 cargo test -p remora-crds`.

use std::path::PathBuf;

fn crd_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/remora/crds")
}

#[test]
fn committed_crd_yaml_has_not_drifted() -> anyhow::Result<()> {
    let dir = crd_dir();
    let files = remora_crds::crd_files()?;
    if std::env::var_os("REMORA_BLESS").is_some() {
        for (name, yaml) in &files {
            std::fs::write(dir.join(name), yaml)?;
        }
    }
    for (name, generated) in &files {
        let path = dir.join(name);
        let committed = std::fs::read_to_string(&path).map_err(|e| {
            anyhow::anyhow!(
                "{}: {e} (run with REMORA_BLESS=1 to create it)",
                path.display()
            )
        })?;
        assert!(
            &committed == generated,
            "{} is stale: run `REMORA_BLESS=1 cargo test -p remora-crds` and commit the result",
            path.display()
        );
    }
    // No CRD file the code no longer generates.
    let mut committed: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    committed.sort();
    let mut generated: Vec<String> = files.into_iter().map(|(n, _)| n).collect();
    generated.sort();
    assert_eq!(committed, generated, "{}", dir.display());
    Ok(())
}

#[test]
fn crd_has_the_contracted_shape() -> anyhow::Result<()> {
    let crd = serde_json::to_value(remora_crds::crds().remove(0))?;
    assert_eq!(crd["metadata"]["name"], "sidecarlifecycles.remora.dev");
    assert_eq!(crd["spec"]["group"], "remora.dev");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["kind"], "SidecarLifecycle");
    assert_eq!(crd["spec"]["names"]["shortNames"][0], "slc");
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    assert!(v["subresources"]["status"].is_object());
    let cols: Vec<&str> = v["additionalPrinterColumns"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(cols, ["Mode", "Drain", "ExitOnZero", "Matched", "Age"]);
    let spec = &v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    assert_eq!(
        spec["mode"]["enum"],
        serde_json::json!(["Auto", "Legacy", "Native"])
    );
    assert_eq!(spec["rolloutPolicy"]["default"], "Manual");
    let shutdown = &spec["shutdown"];
    assert_eq!(
        shutdown["x-kubernetes-validations"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    let drain = &shutdown["properties"]["drainDuration"];
    assert_eq!(drain["pattern"], remora_crds::DURATION_PATTERN);
    assert!(
        drain["x-kubernetes-validations"][0]["rule"]
            .as_str()
            .is_some_and(|r| r.contains("duration(self) >= duration('0s')"))
    );
    assert!(
        drain["description"]
            .as_str()
            .is_some_and(|d| d.contains("45s"))
    );
    let status = &v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    for f in ["observedGeneration", "matchedPods", "conditions"] {
        assert!(status[f].is_object(), "status.{f}");
    }
    Ok(())
}

/// The chart's values schema checks durations with the contract's grammar.
#[test]
fn values_schema_uses_the_duration_grammar() -> anyhow::Result<()> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/remora/values.schema.json");
    let schema: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let d = &schema["definitions"]["duration"];
    assert_eq!(d["pattern"], remora_contract::duration::PATTERN);
    assert_eq!(d["maxLength"], remora_contract::duration::MAX_LEN);
    Ok(())
}

#[test]
fn external_service_crd_has_its_status_and_bounds() -> anyhow::Result<()> {
    let crds = remora_crds::crds();
    let names: Vec<_> = crds.iter().map(|c| c.metadata.name.clone()).collect();
    assert_eq!(
        names,
        [
            Some("sidecarlifecycles.remora.dev".to_string()),
            Some("externalservices.remora.dev".to_string()),
            Some("externalworkloads.remora.dev".to_string()),
        ]
    );
    let svc = serde_json::to_value(&crds[1])?;
    let v = &svc["spec"]["versions"][0];
    assert!(v["subresources"]["status"].is_object());
    let spec = &v["schema"]["openAPIV3Schema"]["properties"]["spec"];
    for (list, max) in [("hosts", 16), ("ports", 16), ("endpoints", 64)] {
        assert_eq!(spec["properties"][list]["maxItems"], max, "{list}");
    }
    assert_eq!(
        spec["x-kubernetes-validations"].as_array().map(Vec::len),
        Some(2),
        "{spec}"
    );
    let status = &v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    for f in ["observedGeneration", "endpoints", "conditions"] {
        assert!(status[f].is_object(), "status.{f}");
    }
    let wl = serde_json::to_value(&crds[2])?;
    let wspec = &wl["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(wspec["required"], serde_json::json!(["address"]), "{wspec}");
    assert_eq!(wspec["properties"]["labels"]["maxProperties"], 64);
    Ok(())
}
