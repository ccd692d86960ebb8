//! `IreeRedecodeSession`'s native methods (CONTRACT §3, §5), over [`IreeRedecodeBackend`].

use std::path::Path;
use std::sync::Mutex;

use backend_iree::IreeRedecodeBackend;
use jni::objects::{JIntArray, JString};
use jni::sys::{jint, jlong};
use jni::{Env, EnvUnowned};
use kv_core::RedecodeBackend;

use crate::error::{JniError, JniResult};
use crate::ffi::{self, call, lock};
use crate::handle::{Kind, Registry};

/// The seed's library is not told the vocabulary; ids are passed through to the graph, whose
/// in-graph gather clamps them (StableHLO semantics), so no id can read outside the table.
const VOCAB_UNCHECKED: usize = i32::MAX as usize;

pub struct RedecodeSession {
    backend: Mutex<IreeRedecodeBackend>,
}

static SESSIONS: Registry<RedecodeSession> = Registry::new(Kind::RedecodeSession);

pub fn live_count() -> usize {
    SESSIONS.len()
}

/// Opens a module as `nativeCreate` does; `SEQ` comes from the function's declared input.
pub fn open(
    device: &str,
    vmfb: &str,
    irpa: &str,
    function: &str,
    workers: Option<usize>,
) -> JniResult<IreeRedecodeBackend> {
    Ok(IreeRedecodeBackend::open_files(
        device,
        Path::new(vmfb),
        Path::new(irpa),
        function,
        None,
        VOCAB_UNCHECKED,
        workers,
    )?)
}

fn create(
    env: &mut Env<'_>,
    device: &JString<'_>,
    vmfb: &JString<'_>,
    irpa: &JString<'_>,
    function: &JString<'_>,
    workers: Option<usize>,
) -> JniResult<jlong> {
    let device = ffi::string(env, device, "device")?;
    let backend = open(
        &device,
        &ffi::string(env, vmfb, "vmfbPath")?,
        &ffi::string(env, irpa, "irpaPath")?,
        &ffi::string(env, function, "functionName")?,
        workers,
    )?;
    crate::log::info(&format!(
        "IreeRedecodeSession opened on {device} (SEQ {}, workers {workers:?})",
        backend.seq()
    ));
    Ok(SESSIONS.insert(RedecodeSession {
        backend: Mutex::new(backend),
    }))
}

pub fn native_create<'l>(
    env: EnvUnowned<'l>,
    device: JString<'l>,
    vmfb: JString<'l>,
    irpa: JString<'l>,
    function: JString<'l>,
) -> jlong {
    call(env, "IreeRedecodeSession.nativeCreate", |env| {
        create(env, &device, &vmfb, &irpa, &function, None)
    })
}

/// `groups` is the worker count of the `local-task` executor (ignored by other devices).
pub fn native_create_with_topology<'l>(
    env: EnvUnowned<'l>,
    device: JString<'l>,
    vmfb: JString<'l>,
    irpa: JString<'l>,
    function: JString<'l>,
    groups: jint,
) -> jlong {
    call(env, "IreeRedecodeSession.nativeCreateWithTopology", |env| {
        let workers = usize::try_from(groups)
            .ok()
            .filter(|&g| g > 0)
            .ok_or_else(|| JniError::Argument(format!("groups = {groups}: need at least one worker")))?;
        create(env, &device, &vmfb, &irpa, &function, Some(workers))
    })
}

/// The next id at every position, or `null` when the graph's result breaks the contract (the
/// seed's behaviour: an incompatible vmfb fails loudly instead of misreading device memory).
pub fn native_step<'l>(env: EnvUnowned<'l>, h: jlong, token_ids: JIntArray<'l>) -> JIntArray<'l> {
    call(env, "IreeRedecodeSession.nativeStep", |env| {
        let tokens = ffi::all_ints(env, &token_ids, "tokenIds")?;
        let session = SESSIONS.get(h)?;
        let outcome = lock(&session.backend, "this IreeRedecodeSession")?.run(&tokens);
        match outcome {
            Ok(ids) => ffi::new_ints(env, &ids),
            Err(mismatch @ kv_core::Error::ContractMismatch { .. }) => {
                crate::log::error(&format!("IreeRedecodeSession.nativeStep: returning null: {mismatch}"));
                Ok(JIntArray::default())
            }
            Err(e) => Err(e.into()),
        }
    })
}

pub fn native_destroy(env: EnvUnowned<'_>, h: jlong) {
    call(env, "IreeRedecodeSession.nativeDestroy", |_| {
        SESSIONS.remove(h)?;
        Ok(())
    })
}
