//! Weights stored in the layout their kernels read (IREE's parameter encoder), for CPU modules
//! compiled with data tiling.
//!
//! With `--iree-global-opt-data-tiling` every matmul reads its weight in the CPU's tiles
//! (`linalg.pack`), and IREE hoists each pack into a global filled at module load: a second,
//! anonymous copy of every weight beside the archive (real Gemma 3 270M on contract 2: 1.2 GB
//! peak RSS for 536 MB of weights). Worse, the copies are per function: the chunk, step and two
//! redecode graphs each pack the same weight, four identical initializers (IREE 3.13 folds them
//! into one buffer at run time, but its parameter encoder would write four).
//!
//! So a data-tiled module is compiled in two halves around one rewrite:
//! 1. `--compile-to=global-optimization`: the hoisted packs are now `util.initializer`s;
//! 2. [`dedupe_hoisted`] merges identical initializers (same parameter, same pack) into one
//!    global;
//! 3. `--compile-from=global-optimization` with `--iree-parameter-encoder-output-file`: the
//!    module reads the packed weights as parameters of scope [`ENCODED_SCOPE`] instead of
//!    computing them, and IREE writes the encoder module that computes them;
//! 4. the encoder module runs once, here, through `iree-encode-parameters` (built from the same
//!    IREE runtime sources as ours by `scripts/build-iree-tools.sh`), writing the encoded archive.
//!
//! The runtime maps both archives (`iree_runtime::ParameterIo::Mapped`), so each weight is in
//! memory once, as file pages. `overlay` mode: the encoded archive holds only the packed
//! weights; everything else (norms, the embedding the host reads) stays in the model archive.

use std::path::{Path, PathBuf};
use std::process::Command;

use kv_core::manifest::ENCODED_SCOPE;

use crate::compile::{compile_with, find_tool, Target};
use crate::{ExportError, Result};

/// Whether a module compiled with `flags` for `target` gets an encoded archive: CPU modules
/// with data tiling (the only ones whose weights IREE re-lays out at load) and hoisting on
/// (without it nothing is laid out at load: block-quantized weights, `QUANTIZED_COMPILE_FLAGS`).
pub fn wants_encoding(target: &Target, flags: &[String]) -> bool {
    let facts = crate::profile::FlagFacts::of(flags);
    matches!(target, Target::Cpu { .. }) && facts.data_tiling && facts.const_hoisting
}

/// Compiles `mlir` (StableHLO) for `target` with `flags` into `out`, whose packed weights are
/// read from `encoded_out` (written here from `archive`, scope `scope`) under [`ENCODED_SCOPE`].
/// Intermediate files go to a folder beside `out`, removed on success.
pub fn compile_encoded(
    mlir: &Path,
    target: &Target,
    out: &Path,
    flags: &[String],
    archive: &Path,
    scope: &str,
    encoded_out: &Path,
) -> Result<()> {
    let work = out.with_extension("encode");
    std::fs::create_dir_all(&work).map_err(ExportError::io("creating", &work))?;
    let global_opt = work.join("global-opt.mlir");
    let deduped = work.join("global-opt-deduped.mlir");
    let encoder_mlir = work.join("encoder.mlir");
    let encoder_vmfb = work.join("encoder.vmfb");

    let phase = |extra: &[String]| [flags, extra].concat();
    compile_with(
        mlir,
        target,
        &global_opt,
        &phase(&["--compile-to=global-optimization".into()]),
    )?;

    let text = std::fs::read_to_string(&global_opt).map_err(ExportError::io("reading", &global_opt))?;
    std::fs::write(&deduped, dedupe_hoisted(&text).0).map_err(ExportError::io("writing", &deduped))?;

    compile_with(
        &deduped,
        target,
        out,
        &phase(&[
            "--compile-from=global-optimization".into(),
            format!("--iree-parameter-encoder-output-file={}", encoder_mlir.display()),
            "--iree-parameter-encoder-mode=overlay".into(),
            format!("--iree-parameter-encoder-output-scope={ENCODED_SCOPE}"),
        ]),
    )?;
    // The packs are plain data movement: compiled for any x86/ARM host (`generic`), so an export
    // for another CPU than this one still encodes here. The layout itself was fixed in step 3.
    let host = Target::Cpu { cpu: "generic".into() };
    compile_with(&encoder_mlir, &host, &encoder_vmfb, &[])?;

    let tool = find_encoder()?;
    let output = Command::new(&tool)
        .arg(format!("--module={}", encoder_vmfb.display()))
        .arg(format!("--parameters={scope}={}", archive.display()))
        .arg(format!("--output={ENCODED_SCOPE}={}", encoded_out.display()))
        .arg("--quiet")
        .output()
        .map_err(ExportError::io("running iree-encode-parameters", &tool))?;
    if !output.status.success() {
        return Err(ExportError::Encode {
            module: out.to_path_buf(),
            diagnostic: first_error_line(&output.stderr),
        });
    }
    std::fs::remove_dir_all(&work).map_err(ExportError::io("removing", &work))
}

/// The first error line of a tool's stderr, else its last line.
fn first_error_line(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    text.lines()
        .find(|l| l.contains("error") || l.contains("ERROR") || l.contains("NOT_FOUND"))
        .or_else(|| text.lines().last())
        .unwrap_or("no diagnostic")
        .to_string()
}

/// `IREE_ENCODE_PARAMETERS`, else `iree-encode-parameters` on `PATH`, else `bin/` of the tools
/// root ([`kv_paths::Root::Tools`]), where `scripts/build-iree-tools.sh` puts it. The pinned
/// compiler wheel does not ship this tool.
pub fn find_encoder() -> Result<PathBuf> {
    find_tool(
        "IREE_ENCODE_PARAMETERS",
        "iree-encode-parameters",
        "bin/iree-encode-parameters",
    )
    .map_err(|searched| ExportError::EncoderMissing { searched })
}

/// Merges the hoisted globals of `text` (IREE's global-optimization output) whose declaration
/// and `util.initializer` are the same up to the global's name: the first is kept, the others
/// dropped and every use renamed to it. Returns the new text and the initializer counts before
/// and after.
///
/// The shape relied on is what IREE 3.13 prints for a hoisted value: a line
/// `  util.global private @__hoisted_NAME ... : TYPE` directly followed by its initializer
/// `  util.initializer ... {` up to the closing `  }` at the same indentation. Anything else is
/// left as it is, so at worst nothing merges.
pub fn dedupe_hoisted(text: &str) -> (String, (usize, usize)) {
    const GLOBAL: &str = "  util.global private @__hoisted_";
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<&str> = Vec::with_capacity(lines.len());
    let mut kept: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut renamed: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut total = 0;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let initializer_next = lines.get(i + 1).is_some_and(|l| l.starts_with("  util.initializer"));
        if line.starts_with(GLOBAL) && initializer_next {
            let name = line["  util.global private @".len()..]
                .split(' ')
                .next()
                .unwrap_or_default()
                .to_string();
            let Some(end) = (i + 1..lines.len()).find(|&j| lines[j] == "  }") else {
                out.push(line);
                i += 1;
                continue;
            };
            total += 1;
            let block = &lines[i..=end];
            let key = block
                .iter()
                .map(|l| replace_symbol(l, &name, "__G"))
                .collect::<Vec<_>>()
                .join("\n");
            match kept.get(&key) {
                Some(first) => {
                    renamed.insert(name, first.clone());
                }
                None => {
                    kept.insert(key, name);
                    out.extend_from_slice(block);
                }
            }
            i = end + 1;
            continue;
        }
        out.push(line);
        i += 1;
    }
    let mut text = out.join("\n");
    text.push('\n');
    if !renamed.is_empty() {
        text = rename_symbols(&text, &renamed);
    }
    (text, (total, total - renamed.len()))
}

/// `line` with the symbol `@name` (whole symbol only) replaced by `@to`.
fn replace_symbol(line: &str, name: &str, to: &str) -> String {
    rename_symbols(
        line,
        &std::collections::HashMap::from([(name.to_string(), to.to_string())]),
    )
}

/// Every `@symbol` of `text` that `map` names, replaced (symbols end at the first character that
/// cannot be part of one).
fn rename_symbols(text: &str, map: &std::collections::HashMap<String, String>) -> String {
    let is_symbol_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '$' || c == '.';
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('@') {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let end = rest.find(|c: char| !is_symbol_char(c)).unwrap_or(rest.len());
        let symbol = &rest[..end];
        out.push_str(map.get(symbol).map(String::as_str).unwrap_or(symbol));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hoisted(name: &str, param: &str) -> String {
        format!(
            "  util.global private @{name} {{stream.affinity.default = #hal.device.affinity<@__device_0>}} : tensor<4x2x16x1xbf16>\n  \
             util.initializer attributes {{stream.affinity.default = #hal.device.affinity<@__device_0>}} {{\n    \
             %0 = flow.tensor.constant #flow.parameter.named<\"model\"::\"{param}\"> : tensor<64x2xbf16>\n    \
             %1 = tensor.empty() : tensor<4x2x16x1xbf16>\n    \
             %pack = linalg.pack %0 inner_dims_pos = [0, 1] inner_tiles = [16, 1] into %1 : tensor<64x2xbf16> -> tensor<4x2x16x1xbf16>\n    \
             util.global.store %pack, @{name} : tensor<4x2x16x1xbf16>\n    \
             util.return\n  }}\n"
        )
    }

    #[test]
    fn identical_initializers_merge_and_uses_follow() {
        let text = format!(
            "module {{\n{}{}{}  util.func public @f() {{\n    %a = util.global.load @__hoisted_b : tensor<4x2x16x1xbf16>\n    \
             %b = util.global.load @__hoisted_b_1 : tensor<4x2x16x1xbf16>\n    %c = util.global.load @__hoisted_c : tensor<4x2x16x1xbf16>\n  }}\n}}\n",
            hoisted("__hoisted_b", "w.q"),
            hoisted("__hoisted_b_1", "w.q"),
            hoisted("__hoisted_c", "w.k"),
        );
        let (out, counts) = dedupe_hoisted(&text);
        assert_eq!(counts, (3, 2));
        assert_eq!(out.matches("util.initializer").count(), 2);
        assert!(!out.contains("@__hoisted_b_1"), "{out}");
        assert_eq!(out.matches("util.global.load @__hoisted_b :").count(), 2, "{out}");
        assert!(out.contains("util.global.load @__hoisted_c :"), "{out}");
    }

    #[test]
    fn different_parameters_or_unknown_shapes_stay() {
        let text = format!("{}{}", hoisted("__hoisted_x", "w.a"), hoisted("__hoisted_y", "w.b"));
        let (out, counts) = dedupe_hoisted(&text);
        assert_eq!(counts, (2, 2));
        assert_eq!(out, text);
        // A global without an initializer after it (a dense constant) is left alone.
        let constant = "  util.global private @__hoisted_k = dense<1> : tensor<2xi32>\n  util.global private @__hoisted_k_0 = dense<1> : tensor<2xi32>\n";
        assert_eq!(dedupe_hoisted(constant), (constant.to_string(), (0, 0)));
    }

    #[test]
    fn symbols_rename_whole() {
        let map = std::collections::HashMap::from([("__hoisted_a".to_string(), "__hoisted_z".to_string())]);
        assert_eq!(
            rename_symbols("@__hoisted_a @__hoisted_ab @__hoisted_a, @__hoisted_a", &map),
            "@__hoisted_z @__hoisted_ab @__hoisted_z, @__hoisted_z"
        );
    }

    #[test]
    fn encoding_only_for_data_tiled_cpu_modules() {
        let tiled = vec![
            "--iree-opt-level=O3".to_string(),
            "--iree-global-opt-data-tiling".to_string(),
        ];
        assert!(wants_encoding(&Target::cpu(), &tiled));
        assert!(!wants_encoding(&Target::vulkan(), &tiled));
        assert!(!wants_encoding(&Target::cpu(), &["--iree-opt-level=O3".to_string()]));
        let unhoisted = [tiled.clone(), vec!["--iree-opt-const-expr-hoisting=false".to_string()]].concat();
        assert!(!wants_encoding(&Target::cpu(), &unhoisted));
    }
}
