//! `libskainet_iree_kv.so`: the native methods of
//! `sk.ainet.transformers.iree.android.IreeKvSession` (CONTRACT §5) and of `IreeKvSnapshotFile`
//! (snapshot files, beside the seed ABI). Each export only forwards to
//! `skainet_jni::kv`, where the error policy, handles and conversions live. Beside them, the
//! app-level API's `Engine` and `Conversation` (forwarding to `skainet_jni::app`).

use jni::objects::{JIntArray, JObject, JString};
use jni::sys::{jboolean, jfloat, jint, jlong};
use skainet_jni::{app, kv};

#[rustfmt::skip]
skainet_jni::java_exports! { 'l, IreeKvSession;
    nativeCreate(device: JString<'l>, spec: JObject<'l>, vmfb_with_past: JString<'l>, irpa_with_past: JString<'l>, fn_with_past: JString<'l>, vmfb_chunk: JString<'l>, irpa_chunk: JString<'l>, fn_chunk: JString<'l>, vmfb_prefill: JString<'l>, irpa_prefill: JString<'l>, fn_prefill: JString<'l>) -> jlong = kv::native_create;
    nativePrefill(h: jlong, tokens: JIntArray<'l>, n: jint) -> jint = kv::native_prefill;
    nativeChunk(h: jlong, tokens: JIntArray<'l>, n: jint) -> jint = kv::native_chunk;
    nativeStep(h: jlong, token: jint) -> jint = kv::native_step;
    nativeSnapshot(h: jlong) -> jlong = kv::native_snapshot;
    nativeRestore(h: jlong, snapshot: jlong) = kv::native_restore;
    nativeReleaseSnapshot(snapshot: jlong) = kv::native_release_snapshot;
    nativeReleasePrefill(h: jlong) = kv::native_release_prefill;
    nativePosition(h: jlong) -> jint = kv::native_position;
    nativeDestroy(h: jlong) = kv::native_destroy;
}

// Not part of the seed's ABI: snapshot files, for `IreeKvSnapshotFile` (same library).
#[rustfmt::skip]
skainet_jni::java_exports! { 'l, IreeKvSnapshotFile;
    nativeSave(h: jlong, snapshot: jlong, path: JString<'l>) -> jlong = kv::native_save_snapshot_file;
    nativeLoad(h: jlong, path: JString<'l>) -> jlong = kv::native_load_snapshot_file;
    nativeSnapshotPosition(snapshot: jlong) -> jint = kv::native_snapshot_position;
}

// Not part of the seed's ABI: the app-level API (`Engine`, `Conversation`; docs/android.md).
// A module per class: the macro names each Rust function after its method, and `nativeCreate`
// / `nativeClose` exist in more than one class.
pub mod engine {
    use super::*;
    #[rustfmt::skip]
skainet_jni::java_exports! { 'l, Engine;
    nativeOpen(dir: JString<'l>, device: JString<'l>) -> jlong = app::native_open;
    nativeInfo(h: jlong) -> JObject<'l> = app::native_info;
    nativeClose(h: jlong) = app::native_close_engine;
    nativeBeginDeviceProfile(h: jlong, path: JString<'l>) = app::native_begin_device_profile;
    nativeEndDeviceProfile(h: jlong) = app::native_end_device_profile;
}
}

pub mod conversation {
    use super::*;
    #[rustfmt::skip]
skainet_jni::java_exports! { 'l, Conversation;
    nativeCreate(engine: jlong, system: JString<'l>, tools_json: JString<'l>, tool_choice: JString<'l>, max_new_tokens: jint, constrained: jboolean, temperature: jfloat, top_k: jint, top_p: jfloat, min_p: jfloat, repetition_penalty: jfloat, seed: jlong, catalog_file: JString<'l>) -> jlong = app::native_create;
    nativeCatalogSource(h: jlong) -> jint = app::native_catalog_source;
    nativeSend(h: jlong, text: JString<'l>, listener: JObject<'l>) -> JObject<'l> = app::native_send;
    nativeCancel(h: jlong) = app::native_cancel;
    nativeSaveCatalog(h: jlong, path: JString<'l>) -> jlong = app::native_save_catalog;
    nativeClose(h: jlong) = app::native_close_conversation;
}
}
