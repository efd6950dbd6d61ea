//! Why the controller fails a reconcile.

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("writing the status of {resource}: {source}")]
    Status {
        resource: String,
        #[source]
        source: kube::Error,
    },
    #[error("patching the lifecycle annotation of pod {pod}: {source}")]
    Retune {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error("rolling {workload}: {source}")]
    Rollout {
        workload: String,
        #[source]
        source: kube::Error,
    },
}

impl ControllerError {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Self::Status { .. } => "status",
            Self::Retune { .. } => "retune",
            Self::Rollout { .. } => "rollout",
        }
    }
}
