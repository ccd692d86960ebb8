//! `manifest.json`: the spec, function names, argument/result name lists, and the artifact files
//! (CONTRACT §1–2). A runtime binds graph arguments by these names, so a tracer that reorders
//! arguments does not break it; validation makes sure every name a graph needs is present once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::spec::{Architecture, KvSpec, LayerKind};

pub const CONTRACT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";

/// The optional results of the prefill, chunk and step graphs exported with a top-k
/// (`Manifest::top_k`): the best `k` logits of the last position, `f32 [k]`, sorted descending,
/// ties lowest id first, and their ids, `i32 [k]`. They follow `token` in the canonical order.
pub const TOPK_LOGITS: &str = "topk.logits";
pub const TOPK_IDS: &str = "topk.ids";

/// The graphs of the contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Graph {
    /// `prefill_at`: `[SEQ]` tokens from position 0.
    Prefill,
    /// `prefill_with_past`: `C` tokens after a dynamic `past`.
    Chunk,
    /// `with_past`: one token after a dynamic `past`.
    Step,
    /// Redecode: `[1, SEQ] → [SEQ]` next ids.
    Redecode,
    /// Redecode `_at`: `[1, SEQ]` and `select [1, SEQ]` → one `token [1]`.
    RedecodeAt,
}

impl Graph {
    pub const KV: [Graph; 3] = [Graph::Prefill, Graph::Chunk, Graph::Step];

    /// The key of this graph in `functions` and `parameters`.
    pub fn key(self) -> &'static str {
        match self {
            Graph::Prefill => "prefill",
            Graph::Chunk => "prefillWithPast",
            Graph::Step => "withPast",
            Graph::Redecode => "redecode",
            Graph::RedecodeAt => "redecodeAt",
        }
    }

    /// The default function name suffix after the family prefix.
    pub fn function_suffix(self) -> &'static str {
        match self {
            Graph::Prefill => "_prefill_at",
            Graph::Chunk => "_prefill_with_past",
            Graph::Step => "_with_past",
            Graph::Redecode => "",
            Graph::RedecodeAt => "_at",
        }
    }
}

pub fn k_name(layer: usize) -> String {
    format!("l{layer}.k")
}
pub fn v_name(layer: usize) -> String {
    format!("l{layer}.v")
}
pub fn cos_name(kind: LayerKind) -> String {
    format!("cos{}", kind.name())
}
pub fn sin_name(kind: LayerKind) -> String {
    format!("sin{}", kind.name())
}
pub fn mask_name(kind: LayerKind) -> String {
    format!("mask{}", kind.name())
}

/// The argument names of a graph in the contract's canonical order (CONTRACT §2).
pub fn canonical_args(graph: Graph, spec: &KvSpec) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    match graph {
        Graph::Prefill => args.extend(["tokens", "emb", "select"].map(String::from)),
        Graph::Chunk | Graph::Step => {
            args.push(if graph == Graph::Chunk { "tokens" } else { "token" }.into());
            args.push("emb".into());
            for layer in 0..spec.n_layers {
                let kind = spec.layer_kind(layer);
                let first = spec.first_layer_of(kind) == Some(layer);
                if first {
                    args.push(cos_name(kind));
                    args.push(sin_name(kind));
                }
                args.push(k_name(layer));
                args.push(v_name(layer));
                if first && graph == Graph::Chunk {
                    args.push(mask_name(kind));
                }
            }
            if graph == Graph::Chunk {
                args.push("select".into());
            }
        }
        Graph::Redecode => args.push("tokens".into()),
        Graph::RedecodeAt => args.extend(["tokens", "select"].map(String::from)),
    }
    args
}

/// The result names of a graph: every layer's K then V in layer order, the token last.
pub fn canonical_outputs(graph: Graph, spec: &KvSpec) -> Vec<String> {
    match graph {
        Graph::Redecode => vec!["ids".into()],
        Graph::RedecodeAt => vec!["token".into()],
        Graph::Prefill | Graph::Chunk | Graph::Step => {
            let mut out: Vec<String> = (0..spec.n_layers).flat_map(|l| [k_name(l), v_name(l)]).collect();
            out.push("token".into());
            out
        }
    }
}

/// Function names per graph key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Functions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_with_past: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub with_past: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redecode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redecode_at: Option<String>,
}

impl Functions {
    /// Module-qualified default names, e.g. `module.gemma_with_past`.
    pub fn with_prefix(prefix: &str) -> Self {
        let name = |g: Graph| Some(format!("module.{prefix}{}", g.function_suffix()));
        Functions {
            prefill: name(Graph::Prefill),
            prefill_with_past: name(Graph::Chunk),
            with_past: name(Graph::Step),
            redecode: name(Graph::Redecode),
            redecode_at: name(Graph::RedecodeAt),
        }
    }

    pub fn get(&self, graph: Graph) -> Option<&str> {
        match graph {
            Graph::Prefill => self.prefill.as_deref(),
            Graph::Chunk => self.prefill_with_past.as_deref(),
            Graph::Step => self.with_past.as_deref(),
            Graph::Redecode => self.redecode.as_deref(),
            Graph::RedecodeAt => self.redecode_at.as_deref(),
        }
    }
}

/// Archive file(s): one shared by every graph, or one per graph key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Parameters {
    Shared(String),
    PerGraph(BTreeMap<String, String>),
}

/// The manifest. Unknown keys are ignored; missing geometry keys take FunctionGemma's values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    #[serde(default = "default_contract_version")]
    pub contract_version: u32,
    #[serde(flatten)]
    pub spec: KvSpec,
    #[serde(default)]
    pub functions: Functions,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_args: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_outputs: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_with_past_args: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_with_past_outputs: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with_past_args: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with_past_outputs: Option<Vec<String>>,
    #[serde(default = "default_scope")]
    pub parameter_scope: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Parameters>,
    /// Archive entry of the `vocab × hidden` bf16 embedding table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_parameter: Option<String>,
    /// Ours: the prefill, chunk and step graphs also return [`TOPK_LOGITS`] and [`TOPK_IDS`]
    /// of this many entries (for sampling); absent = they do not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    /// Ours: what a forward (the reference, the exporter) needs beyond the geometry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<Architecture>,
    /// Ours: compiled modules, `target → graph key → .vmfb file`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub modules: BTreeMap<String, BTreeMap<String, String>>,
    /// Ours: free-form provenance (compiler version, source checkpoint, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub provenance: BTreeMap<String, String>,
}

fn default_contract_version() -> u32 {
    CONTRACT_VERSION
}
fn default_scope() -> String {
    "model".into()
}

impl Manifest {
    /// A manifest with the canonical name lists and default function names.
    pub fn new(spec: KvSpec, architecture: Option<Architecture>, prefix: &str) -> Self {
        let lists = |g| (Some(canonical_args(g, &spec)), Some(canonical_outputs(g, &spec)));
        let (prefill_args, prefill_outputs) = lists(Graph::Prefill);
        let (prefill_with_past_args, prefill_with_past_outputs) = lists(Graph::Chunk);
        let (with_past_args, with_past_outputs) = lists(Graph::Step);
        Manifest {
            contract_version: CONTRACT_VERSION,
            spec,
            functions: Functions::with_prefix(prefix),
            prefill_args,
            prefill_outputs,
            prefill_with_past_args,
            prefill_with_past_outputs,
            with_past_args,
            with_past_outputs,
            parameter_scope: default_scope(),
            parameters: None,
            embedding_parameter: None,
            top_k: None,
            architecture,
            modules: BTreeMap::new(),
            provenance: BTreeMap::new(),
        }
    }

    pub fn from_json(text: &str) -> Result<Self> {
        parse(text, "<string>")
    }

    /// Reads and validates `dir/manifest.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            what: "reading manifest",
            path: path.display().to_string(),
            source,
        })?;
        parse(&text, &path.display().to_string())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| crate::error::invariant(&format!("manifest serialises: {e}")))
    }

    pub fn save(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(MANIFEST_FILE);
        std::fs::write(&path, self.to_json()).map_err(|source| Error::Io {
            what: "writing manifest",
            path: path.display().to_string(),
            source,
        })?;
        Ok(path)
    }

    pub fn validate(&self) -> Result<()> {
        if self.contract_version != CONTRACT_VERSION {
            return Err(Error::manifest(
                "contractVersion",
                format!(
                    "{} is not supported (this runtime speaks {CONTRACT_VERSION})",
                    self.contract_version
                ),
            ));
        }
        self.spec.validate()?;
        if let Some(arch) = &self.architecture {
            arch.validate()?;
        }
        if let Some(k) = self.top_k {
            if k == 0 || k > self.spec.vocab_size {
                return Err(Error::manifest(
                    "topK",
                    format!("{k} must be in 1..={} (the vocabulary)", self.spec.vocab_size),
                ));
            }
        }
        for graph in Graph::KV {
            let (args_key, outputs_key) = list_keys(graph);
            if let Some(args) = self.args(graph) {
                check_same_names(args_key, args, &canonical_args(graph, &self.spec))?;
            }
            if let Some(outputs) = self.outputs(graph) {
                if self.top_k.is_none() {
                    if let Some(extra) = outputs.iter().find(|n| *n == TOPK_LOGITS || *n == TOPK_IDS) {
                        return Err(Error::manifest(
                            outputs_key,
                            format!("`{extra}` is listed but `topK` is not set"),
                        ));
                    }
                }
                check_same_names(outputs_key, outputs, &self.canonical_outputs(graph))?;
            }
        }
        if self.parameter_scope.is_empty() {
            return Err(Error::manifest("parameterScope", "must not be empty"));
        }
        Ok(())
    }

    /// The argument names of a graph, in the order the compiled function takes them.
    pub fn args(&self, graph: Graph) -> Option<&[String]> {
        match graph {
            Graph::Prefill => self.prefill_args.as_deref(),
            Graph::Chunk => self.prefill_with_past_args.as_deref(),
            Graph::Step => self.with_past_args.as_deref(),
            _ => None,
        }
    }

    /// The argument names, falling back to the canonical order when the manifest has no list.
    pub fn args_or_canonical(&self, graph: Graph) -> Vec<String> {
        self.args(graph)
            .map(<[String]>::to_vec)
            .unwrap_or_else(|| canonical_args(graph, &self.spec))
    }

    pub fn outputs(&self, graph: Graph) -> Option<&[String]> {
        match graph {
            Graph::Prefill => self.prefill_outputs.as_deref(),
            Graph::Chunk => self.prefill_with_past_outputs.as_deref(),
            Graph::Step => self.with_past_outputs.as_deref(),
            _ => None,
        }
    }

    pub fn outputs_or_canonical(&self, graph: Graph) -> Vec<String> {
        self.outputs(graph)
            .map(<[String]>::to_vec)
            .unwrap_or_else(|| self.canonical_outputs(graph))
    }

    /// [`canonical_outputs`], then the top-k results where [`Self::top_k`] is set.
    pub fn canonical_outputs(&self, graph: Graph) -> Vec<String> {
        let mut out = canonical_outputs(graph, &self.spec);
        if self.top_k.is_some() && Graph::KV.contains(&graph) {
            out.extend([TOPK_LOGITS, TOPK_IDS].map(String::from));
        }
        out
    }

    /// Sets [`Self::top_k`] and adds (or removes) the top-k results at the end of the prefill,
    /// chunk and step output lists the manifest has.
    pub fn set_top_k(&mut self, k: Option<usize>) {
        self.top_k = k;
        for list in [
            &mut self.prefill_outputs,
            &mut self.prefill_with_past_outputs,
            &mut self.with_past_outputs,
        ]
        .into_iter()
        .flatten()
        {
            list.retain(|n| n != TOPK_LOGITS && n != TOPK_IDS);
            if k.is_some() {
                list.extend([TOPK_LOGITS, TOPK_IDS].map(String::from));
            }
        }
    }

    /// The archive file holding a graph's parameters, if the manifest names one.
    pub fn parameter_file(&self, graph: Graph) -> Option<&str> {
        match self.parameters.as_ref()? {
            Parameters::Shared(file) => Some(file),
            Parameters::PerGraph(map) => map.get(graph.key()).map(String::as_str),
        }
    }

    /// The archive holding the full, canonically named weights (the reference reads it).
    pub fn weights_file(&self) -> Option<&str> {
        match self.parameters.as_ref()? {
            Parameters::Shared(file) => Some(file),
            Parameters::PerGraph(map) => map
                .get("weights")
                .or_else(|| map.get(Graph::Step.key()))
                .map(String::as_str),
        }
    }

    pub fn require_architecture(&self) -> Result<&Architecture> {
        self.architecture
            .as_ref()
            .ok_or_else(|| Error::manifest("architecture", "missing; this backend needs the architecture facts"))
    }
}

/// Parses and validates; a type error names the key it sits under.
fn parse(text: &str, origin: &str) -> Result<Manifest> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|source| Error::ManifestParse {
        path: origin.into(),
        source,
    })?;
    let keyed = |e: serde_path_to_error::Error<serde_json::Error>| {
        let key = e.path().to_string();
        Error::manifest(key, format!("{} (in {origin})", e.into_inner()))
    };
    // The geometry is flattened into the manifest, where serde forgets the key of a type error:
    // read it on its own first so the error names the key.
    serde_path_to_error::deserialize::<_, KvSpec>(&value).map_err(keyed)?;
    let manifest: Manifest = serde_path_to_error::deserialize(&value).map_err(keyed)?;
    manifest.validate()?;
    Ok(manifest)
}

fn list_keys(graph: Graph) -> (&'static str, &'static str) {
    match graph {
        Graph::Prefill => ("prefillArgs", "prefillOutputs"),
        Graph::Chunk => ("prefillWithPastArgs", "prefillWithPastOutputs"),
        Graph::Step => ("withPastArgs", "withPastOutputs"),
        Graph::Redecode => ("redecodeArgs", "redecodeOutputs"),
        Graph::RedecodeAt => ("redecodeAtArgs", "redecodeAtOutputs"),
    }
}

/// The manifest may order names as it likes, but must hold exactly the contract's names once.
fn check_same_names(key: &str, got: &[String], want: &[String]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for name in got {
        if !seen.insert(name.as_str()) {
            return Err(Error::manifest(key, format!("`{name}` is listed twice")));
        }
        if !want.contains(name) {
            return Err(Error::manifest(
                key,
                format!("`{name}` is not an argument of this graph for this spec"),
            ));
        }
    }
    if let Some(missing) = want.iter().find(|n| !seen.contains(n.as_str())) {
        return Err(Error::manifest(key, format!("`{missing}` is missing")));
    }
    Ok(())
}
