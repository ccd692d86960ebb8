//! IREE errors as `kv_core` errors.

use kv_core::Error;

/// A failed IREE call as [`Error::Backend`], the `iree_runtime::Error` (and its status code)
/// kept as the source.
pub(crate) fn iree_err(op: impl Into<String>) -> impl FnOnce(iree_runtime::Error) -> Error {
    let op = op.into();
    move |e| Error::Backend {
        backend: "iree",
        op,
        source: Box::new(e),
    }
}

pub(crate) fn contract_err(op: impl Into<String>, message: impl Into<String>) -> Error {
    Error::ContractMismatch {
        backend: "iree",
        op: op.into(),
        message: message.into(),
    }
}

/// The IREE status code behind `error`, when an IREE call failed with one.
pub fn iree_status(error: &Error) -> Option<iree_runtime::StatusCode> {
    match error {
        Error::Backend { source, .. } => match source.downcast_ref::<iree_runtime::Error>()? {
            iree_runtime::Error::Iree { code, .. } => Some(*code),
            _ => None,
        },
        _ => None,
    }
}
