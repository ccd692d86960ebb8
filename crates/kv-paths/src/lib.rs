//! Where skainet-kv keeps what it makes (exports, fixtures, installed models) and finds the tools
//! it runs (`iree-compile`, the venv's Python), decided here and only here.
//!
//! Design:
//! - **A library does not know its checkout.** A `cargo install`ed binary or an app that links a
//!   crate has no source tree, so no path is derived from where a crate was compiled. Each root
//!   is, in this order: the caller's explicit path, else its environment variable
//!   ([`Root::var`]), else the platform's directory for it ([`dirs`]).
//! - **Developer builds choose the checkout explicitly.** `scripts/env.sh` exports
//!   `SKAINET_KV_CACHE=<checkout>/.cache` and `SKAINET_KV_TOOLS=<checkout>/.tools` (unless already
//!   set), so tests, CI and the scripts keep using the checkout's folders.
//! - **No silent fallback.** Where neither a variable nor a platform directory exists (no home
//!   directory), the error names the variable to set.

mod fill;

pub use fill::{fill_entry, FillError, FillEvent};

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// A directory tree the project writes or reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Root {
    /// Exports (`artifacts/`), fixtures (`fixtures/`) and installed models (`models/`): anything
    /// that can be made again. `$SKAINET_KV_CACHE`, else `<cache dir>/skainet-kv` (Linux
    /// `~/.cache/skainet-kv`, macOS `~/Library/Caches/skainet-kv`).
    Cache,
    /// The Python venv (`venv/`) with the pinned `iree-compile` and pip. `$SKAINET_KV_TOOLS`, else
    /// `<local data dir>/skainet-kv/tools` (Linux `~/.local/share/skainet-kv/tools`): installed
    /// programs, which a cache cleaner should not remove.
    Tools,
}

impl Root {
    /// The environment variable that names this root.
    pub const fn var(self) -> &'static str {
        match self {
            Root::Cache => "SKAINET_KV_CACHE",
            Root::Tools => "SKAINET_KV_TOOLS",
        }
    }

    /// The platform's directory for this root, if the platform has one for this user.
    pub fn platform_default(self) -> Option<PathBuf> {
        match self {
            Root::Cache => dirs::cache_dir().map(|d| d.join("skainet-kv")),
            Root::Tools => dirs::data_local_dir().map(|d| d.join("skainet-kv").join("tools")),
        }
    }

    /// `explicit`, else `$VAR`, else [`Self::platform_default`].
    pub fn resolve(self, explicit: Option<&Path>) -> io::Result<PathBuf> {
        resolve_from(self, explicit, std::env::var_os(self.var()), self.platform_default())
    }

    /// `sub` under this root, resolved without an explicit path.
    pub fn join(self, sub: impl AsRef<Path>) -> io::Result<PathBuf> {
        Ok(self.resolve(None)?.join(sub))
    }
}

impl fmt::Display for Root {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Root::Cache => "cache",
            Root::Tools => "tools",
        })
    }
}

/// Neither an explicit path, nor the variable, nor a platform directory.
#[derive(Debug)]
pub struct Unresolved(pub Root);

impl fmt::Display for Unresolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no {} directory: set {} (this platform names no {} directory for this user)",
            self.0,
            self.0.var(),
            self.0
        )
    }
}

impl std::error::Error for Unresolved {}

/// The rule of [`Root::resolve`] over given inputs. An empty variable counts as unset, as
/// `VAR= cmd` is the shell's way of clearing one for a command.
fn resolve_from(
    root: Root,
    explicit: Option<&Path>,
    var: Option<OsString>,
    platform: Option<PathBuf>,
) -> io::Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    if let Some(var) = var.filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(var));
    }
    platform.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, Unresolved(root)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_wins_then_variable_then_platform() {
        let platform = Some(PathBuf::from("/platform"));
        let var = Some(OsString::from("/from-var"));
        let explicit = Path::new("/explicit");
        let got = |e, v, p| resolve_from(Root::Cache, e, v, p).unwrap();
        assert_eq!(got(Some(explicit), var.clone(), platform.clone()), explicit);
        assert_eq!(got(None, var.clone(), platform.clone()), Path::new("/from-var"));
        assert_eq!(got(None, None, platform.clone()), Path::new("/platform"));
        assert_eq!(got(None, Some(OsString::new()), platform), Path::new("/platform"));
    }

    #[test]
    fn nothing_to_go_by_names_the_variable() {
        let err = resolve_from(Root::Tools, None, None, None).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(err.to_string().contains("SKAINET_KV_TOOLS"), "{err}");
        let inner = err.get_ref().and_then(|e| e.downcast_ref::<Unresolved>());
        assert!(matches!(inner, Some(Unresolved(Root::Tools))), "{err:?}");
    }

    #[test]
    fn platform_defaults_are_named_for_the_project() {
        for root in [Root::Cache, Root::Tools] {
            if let Some(p) = root.platform_default() {
                assert!(p.ends_with(match root {
                    Root::Cache => "skainet-kv",
                    Root::Tools => "skainet-kv/tools",
                }));
            }
        }
    }
}
