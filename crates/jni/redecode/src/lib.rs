//! `libskainet_iree_redecode.so`: the native methods of
//! `sk.ainet.transformers.iree.android.IreeRedecodeSession` (CONTRACT §5). Each export only
//! forwards to `skainet_jni::redecode`.

use jni::objects::{JIntArray, JString};
use jni::sys::{jint, jlong};
use skainet_jni::redecode;

#[rustfmt::skip]
skainet_jni::java_exports! { 'l, IreeRedecodeSession;
    nativeCreate(device: JString<'l>, vmfb_path: JString<'l>, irpa_path: JString<'l>, function_name: JString<'l>) -> jlong = redecode::native_create;
    nativeCreateWithTopology(device: JString<'l>, vmfb: JString<'l>, irpa: JString<'l>, function: JString<'l>, groups: jint) -> jlong = redecode::native_create_with_topology;
    nativeStep(h: jlong, token_ids: JIntArray<'l>) -> JIntArray<'l> = redecode::native_step;
    nativeDestroy(h: jlong) = redecode::native_destroy;
}
