//! `libskainet_iree_redecode.so`: the native methods of
//! `sk.ainet.transformers.iree.android.IreeRedecodeSession` (CONTRACT §5). Each export only
//! forwards to `skainet_jni::redecode`.

use jni::objects::{JClass, JIntArray, JString};
use jni::sys::{jint, jlong};
use jni::EnvUnowned;
use skainet_jni::redecode;

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeRedecodeSession_nativeCreate<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    device: JString<'l>,
    vmfb_path: JString<'l>,
    irpa_path: JString<'l>,
    function_name: JString<'l>,
) -> jlong {
    redecode::native_create(env, device, vmfb_path, irpa_path, function_name)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeRedecodeSession_nativeCreateWithTopology<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    device: JString<'l>,
    vmfb: JString<'l>,
    irpa: JString<'l>,
    function: JString<'l>,
    groups: jint,
) -> jlong {
    redecode::native_create_with_topology(env, device, vmfb, irpa, function, groups)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeRedecodeSession_nativeStep<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
    token_ids: JIntArray<'l>,
) -> JIntArray<'l> {
    redecode::native_step(env, h, token_ids)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeRedecodeSession_nativeDestroy<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
) {
    redecode::native_destroy(env, h)
}
