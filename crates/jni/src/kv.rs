//! `IreeKvSession`'s native methods (CONTRACT §5), over [`IreeKvBackend`].

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use backend_iree::{IreeKvBackend, IreeOptions, IreeSnapshot};
use jni::objects::{JIntArray, JObject, JString};
use jni::signature::{FieldSignature, RuntimeFieldSignature};
use jni::strings::JNIString;
use jni::sys::{jint, jlong};
use jni::{Env, EnvUnowned};
use kv_core::manifest::Parameters;
use kv_core::snapshot_file;
use kv_core::{Graph, KvBackend, KvSpec, Manifest};

use crate::error::{JniError, JniResult};
use crate::ffi::{self, call, lock};
use crate::handle::{Kind, Registry};

/// `modules` key of the manifest `nativeCreate` builds; the device name alone picks the driver.
const TARGET: &str = "jni";

/// The context limit of a JNI session. The seed's library had none beyond memory, and the
/// `IreeKvSpec` carries none: the largest every spec may declare (`kv_core::limits`, which
/// refuses more at open; a Java `int` holds it).
pub const MAX_POSITIONS: usize = kv_core::limits::MAX_POSITIONS;

pub struct KvSession {
    backend: Mutex<IreeKvBackend>,
}

pub struct KvSnapshot {
    snapshot: IreeSnapshot,
}

static SESSIONS: Registry<KvSession> = Registry::new(Kind::KvSession);
static SNAPSHOTS: Registry<KvSnapshot> = Registry::new(Kind::KvSnapshot);

/// Live sessions and snapshots (tests check that nothing leaks).
pub fn live_counts() -> (usize, usize) {
    (SESSIONS.len(), SNAPSHOTS.len())
}

/// The files and function of one graph, as `nativeCreate` receives them.
pub struct GraphFiles {
    pub vmfb: String,
    pub irpa: String,
    pub function: String,
}

/// The in-memory manifest of `nativeCreate`: the spec's geometry, canonical argument order (the
/// seed's graphs take their arguments in that order), each graph's files and function. `seq` is
/// a placeholder here; [`IreeKvBackend::open_manifest_learning_seq`] reads the prefill graph's
/// SEQ from its declared `tokens` shape (the length of the seed's Kotlin prefill array).
pub fn manifest(spec: KvSpec, with_past: GraphFiles, chunk: GraphFiles, prefill: Option<GraphFiles>) -> Manifest {
    let spec = KvSpec {
        seq: spec.chunk.max(1),
        max_positions: MAX_POSITIONS,
        ..spec
    };
    let mut manifest = Manifest::new(spec, None, "jni");
    manifest.functions.with_past = Some(with_past.function.clone());
    manifest.functions.prefill_with_past = Some(chunk.function.clone());
    manifest.functions.prefill = prefill.as_ref().map(|p| p.function.clone());
    let mut modules = BTreeMap::new();
    let mut archives = BTreeMap::new();
    for (graph, files) in [
        (Graph::Step, Some(&with_past)),
        (Graph::Chunk, Some(&chunk)),
        (Graph::Prefill, prefill.as_ref()),
    ] {
        if let Some(files) = files {
            modules.insert(graph.key().to_string(), files.vmfb.clone());
            archives.insert(graph.key().to_string(), files.irpa.clone());
        }
    }
    manifest.modules.insert(TARGET.into(), modules);
    manifest.parameters = Some(Parameters::PerGraph(archives));
    manifest
}

/// Opens a session the way `nativeCreate` does.
pub fn open(device: &str, manifest: Manifest) -> JniResult<IreeKvBackend> {
    let options = IreeOptions {
        target: Some(TARGET.into()),
        ..IreeOptions::new(device)
    };
    Ok(IreeKvBackend::open_manifest_learning_seq(
        Path::new(""),
        manifest,
        options,
    )?)
}

const INT_FIELDS: [&str; 10] = [
    "nLayers",
    "headDim",
    "nKvHeads",
    "nHeads",
    "hiddenSize",
    "vocabSize",
    "slidingWindow",
    "globalLayerPeriod",
    "chunk",
    "maskHeads",
];
const FLOAT_FIELDS: [&str; 2] = ["slidingRopeBase", "globalRopeBase"];

/// Reads an `IreeKvSpec` by field name and type.
fn read_spec(env: &mut Env<'_>, spec: &JObject<'_>) -> JniResult<KvSpec> {
    if spec.is_null() {
        return Err(JniError::Argument("`spec` is null".into()));
    }
    let int_sig = RuntimeFieldSignature::from_str("I")?;
    let float_sig = RuntimeFieldSignature::from_str("F")?;
    let mut ints = BTreeMap::new();
    for name in INT_FIELDS {
        let value = env
            .get_field(spec, JNIString::from(name), FieldSignature::from(&int_sig))?
            .i()?;
        let value = usize::try_from(value)
            .map_err(|_| JniError::Argument(format!("IreeKvSpec.{name} = {value} is negative")))?;
        ints.insert(name, value);
    }
    let mut floats = BTreeMap::new();
    for name in FLOAT_FIELDS {
        floats.insert(
            name,
            env.get_field(spec, JNIString::from(name), FieldSignature::from(&float_sig))?
                .f()?,
        );
    }
    Ok(KvSpec {
        n_layers: ints["nLayers"],
        head_dim: ints["headDim"],
        n_kv_heads: ints["nKvHeads"],
        n_heads: ints["nHeads"],
        hidden_size: ints["hiddenSize"],
        vocab_size: ints["vocabSize"],
        sliding_window: ints["slidingWindow"],
        global_layer_period: ints["globalLayerPeriod"],
        chunk: ints["chunk"],
        mask_heads: ints["maskHeads"],
        sliding_rope_base: floats["slidingRopeBase"],
        global_rope_base: floats["globalRopeBase"],
        ..KvSpec::default()
    })
}

fn session(h: jlong) -> JniResult<std::sync::Arc<KvSession>> {
    SESSIONS.get(h)
}

fn with_backend<T>(h: jlong, f: impl FnOnce(&mut IreeKvBackend) -> JniResult<T>) -> JniResult<T> {
    let session = session(h)?;
    let mut backend = lock(&session.backend, "this IreeKvSession")?;
    f(&mut backend)
}

#[allow(clippy::too_many_arguments)]
pub fn native_create<'l>(
    env: EnvUnowned<'l>,
    device: JString<'l>,
    spec: JObject<'l>,
    vmfb_with_past: JString<'l>,
    irpa_with_past: JString<'l>,
    fn_with_past: JString<'l>,
    vmfb_chunk: JString<'l>,
    irpa_chunk: JString<'l>,
    fn_chunk: JString<'l>,
    vmfb_prefill: JString<'l>,
    irpa_prefill: JString<'l>,
    fn_prefill: JString<'l>,
) -> jlong {
    call(env, "IreeKvSession.nativeCreate", |env| {
        let device = ffi::string(env, &device, "device")?;
        let spec = read_spec(env, &spec)?;
        let files = |env: &Env<'_>, vmfb: &JString<'_>, irpa: &JString<'_>, function: &JString<'_>, graph: &str| {
            JniResult::Ok(GraphFiles {
                vmfb: ffi::string(env, vmfb, &format!("vmfb{graph}"))?,
                irpa: ffi::string(env, irpa, &format!("irpa{graph}"))?,
                function: ffi::string(env, function, &format!("fn{graph}"))?,
            })
        };
        let with_past = files(env, &vmfb_with_past, &irpa_with_past, &fn_with_past, "WithPast")?;
        let chunk = files(env, &vmfb_chunk, &irpa_chunk, &fn_chunk, "Chunk")?;
        let prefill = match vmfb_prefill.is_null() {
            true => None,
            false => Some(files(env, &vmfb_prefill, &irpa_prefill, &fn_prefill, "Prefill")?),
        };
        let has_prefill = prefill.is_some();
        let backend = open(&device, manifest(spec, with_past, chunk, prefill))?;
        crate::log::info(&match has_prefill {
            true => format!(
                "IreeKvSession opened on {device} (prefill SEQ {}, chunk {})",
                backend.spec().seq,
                backend.spec().chunk
            ),
            false => format!(
                "IreeKvSession opened on {device} without a prefill graph (chunk {})",
                backend.spec().chunk
            ),
        });
        Ok(SESSIONS.insert(KvSession {
            backend: Mutex::new(backend),
        }))
    })
}

pub fn native_prefill<'l>(env: EnvUnowned<'l>, h: jlong, tokens: JIntArray<'l>, n: jint) -> jint {
    call(env, "IreeKvSession.nativePrefill", |env| {
        let tokens = ffi::ints(env, &tokens, n, "tokens")?;
        with_backend(h, |b| Ok(b.prefill(&tokens)?))
    })
}

pub fn native_chunk<'l>(env: EnvUnowned<'l>, h: jlong, tokens: JIntArray<'l>, n: jint) -> jint {
    call(env, "IreeKvSession.nativeChunk", |env| {
        let tokens = ffi::ints(env, &tokens, n, "tokens")?;
        with_backend(h, |b| Ok(b.chunk(&tokens)?))
    })
}

pub fn native_step(env: EnvUnowned<'_>, h: jlong, token: jint) -> jint {
    call(env, "IreeKvSession.nativeStep", |_| {
        with_backend(h, |b| Ok(b.step(token)?))
    })
}

pub fn native_snapshot(env: EnvUnowned<'_>, h: jlong) -> jlong {
    call(env, "IreeKvSession.nativeSnapshot", |_| {
        let snapshot = with_backend(h, |b| Ok(b.snapshot()?))?;
        Ok(SNAPSHOTS.insert(KvSnapshot { snapshot }))
    })
}

pub fn native_restore(env: EnvUnowned<'_>, h: jlong, snapshot: jlong) {
    call(env, "IreeKvSession.nativeRestore", |_| {
        let snapshot = SNAPSHOTS.get(snapshot)?;
        // kv-core refuses a snapshot of another session (ForeignSnapshot).
        with_backend(h, |b| Ok(b.restore(&snapshot.snapshot)?))
    })
}

pub fn native_release_snapshot(env: EnvUnowned<'_>, snapshot: jlong) {
    call(env, "IreeKvSession.nativeReleaseSnapshot", |_| {
        SNAPSHOTS.remove(snapshot)?;
        Ok(())
    })
}

pub fn native_release_prefill(env: EnvUnowned<'_>, h: jlong) {
    call(env, "IreeKvSession.nativeReleasePrefill", |_| {
        let released = with_backend(h, |b| Ok(b.release_prefill()))?;
        crate::log::info(match released {
            true => "IreeKvSession: prefill graph released, its module and weights freed",
            false => "IreeKvSession: prefill graph released (later prefills fail); nothing to free: none was opened, or it shares a module with chunk and step",
        });
        Ok(())
    })
}

pub fn native_position(env: EnvUnowned<'_>, h: jlong) -> jint {
    call(env, "IreeKvSession.nativePosition", |_| {
        let position = with_backend(h, |b| Ok(b.position()))?;
        jint::try_from(position).map_err(|_| JniError::Argument(format!("position {position} exceeds a Java int")))
    })
}

pub fn native_destroy(env: EnvUnowned<'_>, h: jlong) {
    call(env, "IreeKvSession.nativeDestroy", |_| {
        // A call still running on another thread holds its own reference; the session is freed
        // when it returns. Snapshots hold their device buffers until released.
        SESSIONS.remove(h)?;
        Ok(())
    })
}

/// `IreeKvSnapshotFile.nativeSave`: writes `snapshot` of session `h` to `path` (atomically);
/// returns the bytes written.
pub fn native_save_snapshot_file<'l>(env: EnvUnowned<'l>, h: jlong, snapshot: jlong, path: JString<'l>) -> jlong {
    call(env, "IreeKvSnapshotFile.nativeSave", |env| {
        let path = ffi::string(env, &path, "path")?;
        let snapshot = SNAPSHOTS.get(snapshot)?;
        let bytes = with_backend(h, |b| Ok(snapshot_file::save(b, &snapshot.snapshot, Path::new(&path))?))?;
        jlong::try_from(bytes).map_err(|_| JniError::Argument(format!("{bytes} bytes exceed a Java long")))
    })
}

/// `IreeKvSnapshotFile.nativeLoad`: a new snapshot handle of session `h` holding the file's rows
/// (restore it to continue). The session itself is not touched, whatever the outcome.
pub fn native_load_snapshot_file<'l>(env: EnvUnowned<'l>, h: jlong, path: JString<'l>) -> jlong {
    call(env, "IreeKvSnapshotFile.nativeLoad", |env| {
        let path = ffi::string(env, &path, "path")?;
        let snapshot = with_backend(h, |b| Ok(snapshot_file::load(&*b, Path::new(&path))?))?;
        Ok(SNAPSHOTS.insert(KvSnapshot { snapshot }))
    })
}

/// `IreeKvSnapshotFile.nativeSnapshotPosition`: the position a snapshot handle holds.
pub fn native_snapshot_position(env: EnvUnowned<'_>, snapshot: jlong) -> jint {
    call(env, "IreeKvSnapshotFile.nativeSnapshotPosition", |_| {
        let position = SNAPSHOTS.get(snapshot)?.snapshot.position();
        jint::try_from(position).map_err(|_| JniError::Argument(format!("position {position} exceeds a Java int")))
    })
}
