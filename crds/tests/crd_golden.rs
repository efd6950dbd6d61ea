//! The CRD YAML committed to the chart must be what the code generates.
//! Regenerate with `REMORA_BLESS=1 cargo test -p remora-crds`.

use std::path::PathBuf;

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/remora/crds/sidecarlifecycles.remora.dev.yaml")
}

#[test]
fn committed_crd_yaml_has_not_drifted() -> anyhow::Result<()> {
    let generated = remora_crds::crd_yaml()?;
    let path = golden_path();
    if std::env::var_os("REMORA_BLESS").is_some() {
        std::fs::write(&path, &generated)?;
        return Ok(());
    }
    let committed = std::fs::read_to_string(&path).map_err(|e| {
        anyhow::anyhow!(
            "{}: {e} (run with REMORA_BLESS=1 to create it)",
            path.display()
        )
    })?;
    assert!(
        committed == generated,
        "{} is stale: run `REMORA_BLESS=1 cargo test -p remora-crds` and commit the result",
        path.display()
    );
    Ok(())
}

#[test]
fn crd_has_the_contracted_shape() -> anyhow::Result<()> {
    let yaml = remora_crds::crd_yaml()?;
    let crd: serde_json::Value = serde_saphyr::from_str(yaml.trim_start_matches("---\n"))?;
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
