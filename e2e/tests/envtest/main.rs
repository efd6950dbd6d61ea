//! Tests against a real kube-apiserver and etcd started by the harness
//! (`e2e::controlplane`), sharing one control plane: the webhook, the Jobs
//! controller (on `FakeKubelet`: pod states written, nothing run), leader
//! election, the CAs and the chart's objects. One binary, one module per
//! subject. Apart, in binaries of their own, each with its own control plane:
//! `controller` and `rollout_trust` (the SidecarLifecycle controller acts
//! on every namespace, so another test's operator would act on their
//! objects, and theirs on the others'; `rollout_trust` also runs no
//! controller manager) and `leader_memory` (it reads an operator's RSS,
//! which other tests' objects would move).

mod ca_rotation;
mod cert_renewal;
mod chart;
mod controlplane;
mod external_crd;
mod jobs;
mod leader;
mod least_privilege;
mod webhook;
