//! [`IreeRedecodeBackend`]: the fixed-length redecode graph (CONTRACT §3).

use std::collections::HashMap;
use std::path::Path;

use std::sync::Arc;

use iree_runtime::{BufferView, Device, ElementType, Function};
use kv_core::irpa::FileStamp;
use kv_core::{Error, Graph, Manifest, RedecodeBackend, Result};

use crate::convert::{contract_err, iree_err};
use crate::open::{open_graphs, IreeOptions, Opened};
use crate::shared::SharedModule;

/// `f(tokens [1, SEQ] i32) → [SEQ] i32`, the next id at every position, argmax in-graph.
pub struct IreeRedecodeBackend {
    device: Device,
    session: Arc<SharedModule>,
    /// The session's parameter archive as it was at open (checked before each call).
    archives: Vec<FileStamp>,
    function: Function,
    seq: usize,
    vocab: usize,
    device_name: String,
}

impl IreeRedecodeBackend {
    /// Opens the redecode graph of an artifact directory. Its `SEQ` is the manifest's
    /// `provenance.redecodeSeq` when present, else `seq`.
    pub fn open(dir: &Path, options: IreeOptions) -> Result<Self> {
        let manifest = Manifest::load(dir)?;
        let seq = manifest.provenance.redecode_seq.unwrap_or(manifest.spec.seq);
        let Opened {
            device,
            mut sessions,
            mut archives,
            mut functions,
            ..
        } = open_graphs(dir, &manifest, &[Graph::Redecode], &options)?;
        let (index, function) = functions
            .remove(&Graph::Redecode)
            .unwrap_or_else(|| kv_core::error::invariant("opened graph"));
        let session = sessions[index]
            .take()
            .unwrap_or_else(|| kv_core::error::invariant("opened session"));
        let archives = archives.swap_remove(index);
        Ok(IreeRedecodeBackend {
            device,
            session,
            archives,
            function,
            seq,
            vocab: manifest.spec.vocab_size,
            device_name: options.device,
        })
    }

    /// Opens a single module the way the seed's `nativeCreate(device, vmfb, irpa, fn)` does:
    /// no manifest. `seq: None` learns `SEQ` from the function's declared `[1, SEQ]` input, or,
    /// for a module without that reflection, from the length of the first call's tokens.
    pub fn open_files(
        device: &str,
        vmfb: &Path,
        irpa: &Path,
        function: &str,
        seq: Option<usize>,
        vocab: usize,
        workers: Option<usize>,
    ) -> Result<Self> {
        let mut manifest = Manifest::new(
            kv_core::KvSpec {
                vocab_size: vocab,
                ..Default::default()
            },
            None,
            "unused",
        );
        manifest.modules.insert(
            "m".into(),
            HashMap::from([(Graph::Redecode.key().to_string(), vmfb.display().to_string())])
                .into_iter()
                .collect(),
        );
        manifest.parameters = Some(kv_core::manifest::Parameters::Shared(irpa.display().to_string()));
        manifest.functions.redecode = Some(function.into());
        let options = IreeOptions {
            device: device.into(),
            target: Some("m".into()),
            workers,
            ..IreeOptions::new(device)
        };
        let Opened {
            device,
            mut sessions,
            mut archives,
            mut functions,
            ..
        } = open_graphs(Path::new(""), &manifest, &[Graph::Redecode], &options)?;
        let (index, function) = functions
            .remove(&Graph::Redecode)
            .unwrap_or_else(|| kv_core::error::invariant("opened graph"));
        let session = sessions[index]
            .take()
            .unwrap_or_else(|| kv_core::error::invariant("opened session"));
        let archives = archives.swap_remove(index);
        let seq = seq
            .or_else(|| match crate::open::declared_input_dims(&function, 0).as_deref() {
                Some(&[Some(1), Some(seq)]) => Some(seq),
                _ => None,
            })
            .unwrap_or(0);
        Ok(IreeRedecodeBackend {
            device,
            session,
            archives,
            function,
            seq,
            vocab,
            device_name: options.device,
        })
    }
}

impl RedecodeBackend for IreeRedecodeBackend {
    fn seq(&self) -> usize {
        self.seq
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// A result that breaks the contract (count, rank, length, type) is
    /// [`Error::ContractMismatch`], told apart from a failed call ([`Error::Backend`]): the
    /// seed's `nativeStep` returns `null` for the former.
    fn run(&mut self, tokens: &[i32]) -> Result<Vec<i32>> {
        if self.seq == 0 && !tokens.is_empty() {
            self.seq = tokens.len();
        }
        if tokens.len() != self.seq {
            return Err(Error::BadTokenCount {
                op: "redecode run",
                n: tokens.len(),
                min: self.seq,
                max: self.seq,
            });
        }
        for archive in &self.archives {
            archive.check()?;
        }
        let input = BufferView::from_i32(&self.device, &[1, self.seq], tokens).map_err(iree_err("upload tokens"))?;
        let results = self
            .session
            .lock()
            .call_function(&self.function, &[&input])
            .map_err(iree_err(format!("call {}", self.function.name)))?;
        // Checked before any read: a vmfb of another shape must fail, not misread device memory.
        let [out] = &results[..] else {
            return Err(contract_err(
                "redecode",
                format!("{} returned {} results, expected 1", self.function.name, results.len()),
            ));
        };
        if out.shape() != [self.seq] || out.element_type() != ElementType::I32 {
            return Err(contract_err(
                "redecode",
                format!(
                    "result is {:?} {:?}, the contract says I32 [{}]",
                    out.element_type(),
                    out.shape(),
                    self.seq
                ),
            ));
        }
        out.to_i32_vec().map_err(iree_err("read ids"))
    }

    fn name(&self) -> String {
        format!("iree-{}-redecode", self.device_name)
    }
}
