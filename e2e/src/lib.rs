//! End-to-end harness (control plane, kubelet-emulating pod runner): later issues.
