//! Known divergences: data with a reason, never a silent early return (wgpu's `FailureCase`).

/// A problem that a backend is known to fail, and why.
#[derive(Clone, Copy, Debug)]
pub struct KnownDivergence {
    /// Backend name prefix as `KvBackend::name()` reports it (`iree-vulkan`, ...).
    pub backend: &'static str,
    pub problem: &'static str,
    pub reason: &'static str,
}

/// Every divergence we accept today. Empty is the goal; an entry needs a reason a reader can check.
pub const KNOWN: &[KnownDivergence] = &[];

/// The recorded divergence for this backend and problem, if any.
pub fn known(backend: &str, problem: &str) -> Option<&'static KnownDivergence> {
    KNOWN
        .iter()
        .find(|d| backend.starts_with(d.backend) && d.problem == problem)
}
