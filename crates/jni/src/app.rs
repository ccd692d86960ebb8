//! The native methods of the app-level Kotlin API (`Engine`, `Conversation`), beside the seed's
//! ABI in the same `libskainet_iree_kv.so`: a thin shell over the `engine` crate on
//! [`IreeKvBackend`]. Failures throw `EngineException` with a `[kind]` ([`ffi::call_engine`]).
//!
//! Handles follow the crate's rules (typed registries, never reused). Closing an engine frees
//! its session and catalogs at once, even while conversations of it are open: they then refuse
//! every call as closed. `nativeCancel` takes no lock, so it reaches a send in progress.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use backend_iree::{IreeKvBackend, IreeOptions};
use engine::{Conversation, ConversationConfig, Engine, Reply, Sampling};
use jni::objects::{JObject, JObjectArray, JString};
use jni::sys::{jboolean, jfloat, jint, jlong};
use jni::{jni_sig, jni_str, Env, EnvUnowned, JValue};
use kv_core::Manifest;

use crate::error::{JniError, JniResult};
use crate::ffi::{self, call_engine};
use crate::handle::{Kind, Registry};

type IreeEngine = Engine<IreeKvBackend>;

static ENGINES: Registry<Arc<IreeEngine>> = Registry::new(Kind::Engine);
static CONVERSATIONS: Registry<Conversation<IreeKvBackend>> = Registry::new(Kind::Conversation);

/// Live engines and conversations (tests check that nothing leaks).
pub fn live_counts() -> (usize, usize) {
    (ENGINES.len(), CONVERSATIONS.len())
}

/// Opens the export in `dir` on `device`: graphs, tokenizer, chat template and stops as the
/// export wrote them.
pub fn open(dir: &Path, device: &str) -> JniResult<Arc<IreeEngine>> {
    let manifest = Manifest::load(dir).map_err(|e| engine::Error::Model {
        dir: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let tokenizer = engine::load_tokenizer(dir, &manifest)?;
    let name = manifest
        .provenance
        .source_name
        .clone()
        .or_else(|| manifest.provenance.source.clone())
        .unwrap_or_else(|| dir.display().to_string());
    let backend = IreeKvBackend::open(dir, IreeOptions::new(device))?;
    Ok(Engine::new(backend, tokenizer, name)?)
}

pub fn native_open<'l>(env: EnvUnowned<'l>, dir: JString<'l>, device: JString<'l>) -> jlong {
    call_engine(env, "Engine.open", |env| {
        let dir = ffi::string(env, &dir, "exportDir")?;
        let device = ffi::string(env, &device, "device")?;
        let engine = open(Path::new(&dir), &device)?;
        crate::log::info(&format!("Engine opened: {} on {device} from {dir}", engine.name()));
        Ok(ENGINES.insert(engine))
    })
}

/// `[name, toolFormat or "", vocabSize, maxPositions, stop ids comma-separated]`.
pub fn native_info<'l>(env: EnvUnowned<'l>, h: jlong) -> JObject<'l> {
    call_engine(env, "Engine.info", |env| {
        let engine = ENGINES.get(h)?;
        let spec = engine.spec()?;
        let stops: Vec<String> = engine.stop_ids().iter().map(i32::to_string).collect();
        strings(
            env,
            &[
                engine.name().to_string(),
                engine.tool_format().map_or("", |f| f.name()).to_string(),
                spec.vocab_size.to_string(),
                spec.max_positions.to_string(),
                stops.join(","),
            ],
        )
    })
}

pub fn native_begin_device_profile<'l>(env: EnvUnowned<'l>, h: jlong, path: JString<'l>) {
    call_engine(env, "Engine.beginDeviceProfile", |env| {
        let engine = ENGINES.get(h)?;
        let path = ffi::string(env, &path, "path")?;
        engine.begin_device_profile(Path::new(&path))?;
        Ok(())
    })
}

pub fn native_end_device_profile(env: EnvUnowned<'_>, h: jlong) {
    call_engine(env, "Engine.endDeviceProfile", |_| {
        ENGINES.get(h)?.end_device_profile()?;
        Ok(())
    })
}

pub fn native_close_engine(env: EnvUnowned<'_>, h: jlong) {
    call_engine(env, "Engine.close", |_| {
        ENGINES.remove(h)?.close();
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
pub fn native_create<'l>(
    env: EnvUnowned<'l>,
    engine: jlong,
    system: JString<'l>,
    tools_json: JString<'l>,
    tool_choice: JString<'l>,
    max_new_tokens: jint,
    constrained: jboolean,
    temperature: jfloat,
    top_k: jint,
    top_p: jfloat,
    min_p: jfloat,
    repetition_penalty: jfloat,
    seed: jlong,
    catalog_file: JString<'l>,
) -> jlong {
    call_engine(env, "Conversation.create", |env| {
        let engine = ENGINES.get(engine)?;
        let count = |name: &str, v: jint| {
            usize::try_from(v).map_err(|_| JniError::Argument(format!("`{name}` = {v} is negative")))
        };
        let config = ConversationConfig {
            system: ffi::optional_string(env, &system)?,
            tools_json: ffi::optional_string(env, &tools_json)?,
            tool_choice: ffi::string(env, &tool_choice, "toolChoice")?,
            max_new_tokens: count("maxNewTokens", max_new_tokens)?,
            constrained,
            sampling: Sampling {
                temperature,
                top_k: count("topK", top_k)?,
                top_p,
                min_p,
                repetition_penalty,
                seed: seed as u64,
            },
            catalog_file: ffi::optional_string(env, &catalog_file)?.map(PathBuf::from),
        };
        let conversation = Conversation::new(&engine, &config)?;
        Ok(CONVERSATIONS.insert(conversation))
    })
}

/// 0 prefilled, 1 kept by the engine, 2 loaded from the catalog file.
pub fn native_catalog_source(env: EnvUnowned<'_>, h: jlong) -> jint {
    call_engine(env, "Conversation.catalogSource", |_| {
        Ok(match CONVERSATIONS.get(h)?.catalog_source() {
            engine::CatalogSource::Prefilled => 0,
            engine::CatalogSource::Memory => 1,
            engine::CatalogSource::File => 2,
        })
    })
}

/// Answers `text`, calling `listener.onText(String)` (when not null) with each piece; returns
/// [`reply_strings`]. A listener that throws stops the answer, and its exception propagates.
pub fn native_send<'l>(env: EnvUnowned<'l>, h: jlong, text: JString<'l>, listener: JObject<'l>) -> JObject<'l> {
    call_engine(env, "Conversation.send", |env| {
        let text = ffi::string(env, &text, "text")?;
        let conversation = CONVERSATIONS.get(h)?;
        let mut listener_threw = false;
        let reply = conversation.send(&text, |piece| {
            if listener.is_null() {
                return true;
            }
            // A frame per piece: a long answer would otherwise pile up local references.
            let delivered = env.with_local_frame(2, |env| -> jni::errors::Result<()> {
                let piece = env.new_string(piece)?;
                env.call_method(
                    &listener,
                    jni_str!("onText"),
                    jni_sig!("(Ljava/lang/String;)V"),
                    &[JValue::Object(&piece)],
                )?;
                Ok(())
            });
            listener_threw = delivered.is_err();
            !listener_threw
        })?;
        if listener_threw {
            return Err(JniError::Listener);
        }
        strings(env, &reply_strings(&reply))
    })
}

/// `[text, finish, tokens, requestTokens, elapsedMs, nCalls, (name, argumentsJson) × nCalls,
/// nInvalid, reason × nInvalid]`, what Kotlin's `Reply` reads.
pub fn reply_strings(reply: &Reply) -> Vec<String> {
    let mut out = vec![
        reply.text.clone(),
        reply.finish.name().to_string(),
        reply.tokens.to_string(),
        reply.request_tokens.to_string(),
        format!("{:.3}", reply.elapsed.as_secs_f64() * 1e3),
        reply.tool_calls.len().to_string(),
    ];
    for call in &reply.tool_calls {
        out.push(call.name.clone());
        out.push(serde_json::Value::Object(call.arguments.clone()).to_string());
    }
    out.push(reply.invalid_tool_calls.len().to_string());
    out.extend(reply.invalid_tool_calls.iter().cloned());
    out
}

pub fn native_cancel(env: EnvUnowned<'_>, h: jlong) {
    call_engine(env, "Conversation.cancel", |_| {
        CONVERSATIONS.get(h)?.cancel();
        Ok(())
    })
}

pub fn native_save_catalog<'l>(env: EnvUnowned<'l>, h: jlong, path: JString<'l>) -> jlong {
    call_engine(env, "Conversation.saveCatalog", |env| {
        let path = ffi::string(env, &path, "path")?;
        let bytes = CONVERSATIONS.get(h)?.save_catalog(Path::new(&path))?;
        jlong::try_from(bytes).map_err(|_| JniError::Argument(format!("{bytes} bytes exceed a Java long")))
    })
}

pub fn native_close_conversation(env: EnvUnowned<'_>, h: jlong) {
    call_engine(env, "Conversation.close", |_| {
        // A send in progress on another thread holds its own reference: it is cancelled and
        // returns; the conversation is freed then.
        CONVERSATIONS.remove(h)?.close();
        Ok(())
    })
}

fn strings<'l>(env: &mut Env<'l>, values: &[String]) -> JniResult<JObject<'l>> {
    let array = JObjectArray::<JString>::new(env, values.len(), JString::null())?;
    for (i, value) in values.iter().enumerate() {
        let s = env.new_string(value)?;
        array.set_element(env, i, &s)?;
    }
    Ok(array.into())
}
