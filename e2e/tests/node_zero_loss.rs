//! The product promise, on the real node: a rolling update of 10 replicas
//! (maxSurge 25%, maxUnavailable 0%) under load through a ClusterIP Service
//! and through an ingress 2 s behind the EndpointSlices, from keep-alive
//! clients (90 s idle pool) that never retry, loses no request with
//! Remora's chart defaults, in both sidecar modes; and the same harness
//! loses requests with a plain Envoy sidecar in the same run, so it can
//! lose. Istio's real pilot-agent runs the same rollout beside them, with
//! its defaults and tuned for the lag (`Contender::IstioTunedForLag`): its
//! figures are printed, not asserted. The full matrix (lags, scenarios,
//! clients) is `lifecycle-bench`.

use e2e::node::zero_loss::{Contender, Run, RunResult, run};
use e2e::node::{Node, istio, report};

fn line(r: &RunResult) -> String {
    format!(
        "{:<24} sent {:>5} failed {:>4} {:?}; stop p50 {:.1} s max {:.1} s; {:?}; rollout {:.1} s; kube-proxy: {}; {:?}",
        r.run.contender.name(),
        r.sent,
        r.failed,
        r.failures,
        r.stop_p50_seconds,
        r.stop_max_seconds,
        r.endings,
        r.scenario_seconds,
        r.kube_proxy
            .as_ref()
            .map_or("unread".to_owned(), ToString::to_string),
        r.examples
    )
}

#[tokio::test]
#[ignore = "needs the real node: REMORA_NODE_TESTS=1 cargo test -p e2e --test node_zero_loss -- --ignored (root, scripts/cluster.sh, scripts/images.sh and scripts/images.sh istio-proxy)"]
async fn rolling_update_loses_nothing_with_chart_defaults_and_plain_envoy_does()
-> anyhow::Result<()> {
    let node = Node::for_test("node_zero_loss").await?;
    istio::require_image().await?;
    let client = node.client()?;
    let mut results = Vec::new();
    for contender in [
        Contender::PlainEnvoy,
        Contender::RemoraLegacy,
        Contender::RemoraNative,
        Contender::IstioDefaults,
        Contender::IstioTunedForLag,
    ] {
        let r = run(node, &client, &Run::ci(contender)).await?;
        report(&line(&r));
        for s in &r.stops {
            assert!(
                s.stop_seconds.is_some(),
                "{}: pod {} was not seen deleted and gone",
                contender.name(),
                s.pod
            );
        }
        results.push(r);
    }
    for r in &results {
        assert!(
            r.sent > 0 && r.loads.iter().all(|l| l.sent > 0),
            "{}",
            line(r)
        );
        match r.run.contender {
            Contender::PlainEnvoy => assert!(
                r.failed > 0,
                "the harness must be able to lose: plain Envoy lost nothing ({})",
                line(r)
            ),
            // The peer's figures are reported above, whatever they are.
            Contender::IstioDefaults | Contender::IstioTunedForLag => {}
            _ => {
                assert_eq!(r.failed, 0, "{}", line(r));
                for s in &r.stops {
                    assert_eq!(
                        (s.app_exit, s.proxy_exit),
                        (Some(0), Some(0)),
                        "{}: {s:?}",
                        r.run.contender.name()
                    );
                }
            }
        }
    }
    assert_eq!(node.guard_drops().await?, 0, "nothing left the machine");
    Ok(())
}
