//! IREE errors as `kv_core` errors.

use kv_core::Error;

pub(crate) fn iree_err(op: impl Into<String>) -> impl FnOnce(iree_runtime::Error) -> Error {
    let op = op.into();
    move |e| Error::Backend {
        backend: "iree",
        op,
        message: e.to_string(),
    }
}

pub(crate) fn contract_err(op: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Backend {
        backend: "iree",
        op: op.into(),
        message: message.into(),
    }
}
