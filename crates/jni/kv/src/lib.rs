//! `libskainet_iree_kv.so`: the native methods of
//! `sk.ainet.transformers.iree.android.IreeKvSession` (CONTRACT §5). Each export only forwards to
//! `skainet_jni::kv`, where the error policy, handles and conversions live.

use jni::objects::{JClass, JIntArray, JObject, JString};
use jni::sys::{jint, jlong};
use jni::EnvUnowned;
use skainet_jni::kv;

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeCreate<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
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
    kv::native_create(
        env,
        device,
        spec,
        vmfb_with_past,
        irpa_with_past,
        fn_with_past,
        vmfb_chunk,
        irpa_chunk,
        fn_chunk,
        vmfb_prefill,
        irpa_prefill,
        fn_prefill,
    )
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativePrefill<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
    tokens: JIntArray<'l>,
    n: jint,
) -> jint {
    kv::native_prefill(env, h, tokens, n)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeChunk<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
    tokens: JIntArray<'l>,
    n: jint,
) -> jint {
    kv::native_chunk(env, h, tokens, n)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeStep<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
    token: jint,
) -> jint {
    kv::native_step(env, h, token)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeSnapshot<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
) -> jlong {
    kv::native_snapshot(env, h)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeRestore<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
    snapshot: jlong,
) {
    kv::native_restore(env, h, snapshot)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeReleaseSnapshot<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    snapshot: jlong,
) {
    kv::native_release_snapshot(env, snapshot)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeReleasePrefill<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
) {
    kv::native_release_prefill(env, h)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativePosition<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
) -> jint {
    kv::native_position(env, h)
}

#[no_mangle]
pub extern "system" fn Java_sk_ainet_transformers_iree_android_IreeKvSession_nativeDestroy<'l>(
    env: EnvUnowned<'l>,
    _class: JClass<'l>,
    h: jlong,
) {
    kv::native_destroy(env, h)
}
