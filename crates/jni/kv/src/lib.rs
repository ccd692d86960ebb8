//! `libskainet_iree_kv.so`: the native methods of
//! `sk.ainet.transformers.iree.android.IreeKvSession` (CONTRACT §5) and of `IreeKvSnapshotFile`
//! (snapshot files, beside the seed ABI). Each export only forwards to
//! `skainet_jni::kv`, where the error policy, handles and conversions live.

use jni::objects::{JIntArray, JObject, JString};
use jni::sys::{jint, jlong};
use skainet_jni::kv;

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
