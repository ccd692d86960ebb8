//! Filling a cache entry when several processes (and threads) may want it at once.
//!
//! Every writer of the cache (fixtures, quantized copies, exports, the model store's installs
//! and imports) goes through [`fill_entry`], so the cache has one discipline:
//! - **One writer per entry.** An exclusive lock on `.NAME.lock` beside the entry (`flock`
//!   through `fs4`: released when the file is closed, so a killed writer releases it too; per
//!   open file, so threads of one process exclude each other as processes do).
//! - **Freshness is checked again under the lock.** A process that waited finds the entry its
//!   predecessor made and returns it; it never rebuilds or deletes what another just installed.
//! - **Built aside, installed by rename.** The builder writes `.tmp-NAME-PID`; the old entry is
//!   renamed to `.old-NAME-PID` before the new one is renamed into place, so an entry is never
//!   half written, and a crash between the two renames leaves no entry (rebuilt next time)
//!   rather than a mixed one.
//! - **A crash leaves nothing for good.** Only the lock holder writes `.tmp-NAME-*` and
//!   `.old-NAME-*`, so whoever holds the lock removes any it finds: a killed writer's.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

/// What [`fill_entry`] tells its caller before a long wait or a build, so that it can say so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillEvent {
    /// Another process (or thread) holds the entry's lock: it is building it.
    Waiting,
    /// This caller builds the entry (the lock is held, the entry is still not fresh).
    Building,
}

/// Why [`fill_entry`] failed: the cache's own file operations, or the caller's build.
#[derive(Debug)]
pub enum FillError<E> {
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    Build(E),
}

impl<E> FillError<E> {
    /// The build's error as it was, a cache I/O error through `io` (the caller's error type).
    pub fn into_error(self, io: impl FnOnce(&'static str, PathBuf, io::Error) -> E) -> E {
        match self {
            FillError::Io { what, path, source } => io(what, path, source),
            FillError::Build(e) => e,
        }
    }
}

impl<E: std::fmt::Display> std::fmt::Display for FillError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FillError::Io { what, path, source } => write!(f, "{what} {}: {source}", path.display()),
            FillError::Build(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for FillError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FillError::Io { source, .. } => Some(source),
            FillError::Build(e) => Some(e),
        }
    }
}

fn io_err<'a, E>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FillError<E> + 'a {
    move |source| FillError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The entry `entry` (a directory or a file), built by `build` unless `is_fresh` says it is
/// usable as it is. `build` gets the path to write (a directory or a file it creates; it does not
/// exist when `build` is called) and must leave a finished entry there; it runs only while this
/// caller holds the entry's lock, after `is_fresh` failed under it. `notify` hears
/// [`FillEvent::Waiting`] when the lock is busy and [`FillEvent::Building`] before `build`.
pub fn fill_entry<E>(
    entry: &Path,
    is_fresh: impl Fn(&Path) -> bool,
    build: impl FnOnce(&Path) -> Result<(), E>,
    notify: &mut dyn FnMut(FillEvent),
) -> Result<PathBuf, FillError<E>> {
    if is_fresh(entry) {
        return Ok(entry.to_path_buf());
    }
    let (parent, name) = split(entry).map_err(io_err("naming the cache entry", entry))?;
    std::fs::create_dir_all(&parent).map_err(io_err("creating the cache directory", &parent))?;
    let _lock = lock(&parent.join(format!(".{name}.lock")), notify)?;
    sweep(&parent, &name);
    if is_fresh(entry) {
        return Ok(entry.to_path_buf());
    }
    notify(FillEvent::Building);
    let pid = std::process::id();
    let tmp = parent.join(format!(".tmp-{name}-{pid}"));
    remove(&tmp);
    if let Err(e) = build(&tmp) {
        remove(&tmp);
        return Err(FillError::Build(e));
    }
    let old = parent.join(format!(".old-{name}-{pid}"));
    if entry.symlink_metadata().is_ok() {
        // Aside, not deleted in place: `remove_dir_all` of a large entry is not atomic, and the
        // rename below needs the name free.
        std::fs::rename(entry, &old).map_err(io_err("moving aside the stale entry", entry))?;
    }
    let installed = std::fs::rename(&tmp, entry).map_err(io_err("installing", entry));
    remove(&old);
    if installed.is_err() {
        remove(&tmp);
    }
    installed.map(|()| entry.to_path_buf())
}

/// The exclusive lock of an entry, held while the returned file is open.
fn lock<E>(path: &Path, notify: &mut dyn FnMut(FillEvent)) -> Result<File, FillError<E>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io_err("creating the entry lock", path))?;
    // Named in full: std's `File` has lock methods of its own (Rust 1.89) that this crate's MSRV
    // predates.
    let taken = fs4::fs_std::FileExt::try_lock_exclusive(&file).map_err(io_err("locking the cache entry", path))?;
    if !taken {
        notify(FillEvent::Waiting);
        fs4::fs_std::FileExt::lock_exclusive(&file).map_err(io_err("locking the cache entry", path))?;
    }
    Ok(file)
}

fn split(entry: &Path) -> io::Result<(PathBuf, String)> {
    let name = entry
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a cache entry needs a file name"))?;
    let parent = match entry.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// Removes what killed writers of `name` left in `parent`: `.tmp-NAME-PID` and `.old-NAME-PID`
/// (the suffix all digits, so that the temp dirs of `NAME-x` are not taken for `NAME`'s). Called
/// under the entry's lock, which every writer of those names holds.
fn sweep(parent: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let file_name = e.file_name();
        let file_name = file_name.to_string_lossy();
        let stale = [".tmp-", ".old-"].iter().any(|kind| {
            file_name
                .strip_prefix(kind)
                .and_then(|rest| rest.strip_prefix(name))
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        });
        if stale {
            remove(&e.path());
        }
    }
}

/// Removes a file or a directory tree, if there is one.
fn remove(path: &Path) {
    match path.symlink_metadata() {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(path);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(path);
        }
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    fn fresh(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("done")).is_ok_and(|s| s == "v2")
    }

    fn build(dir: &Path) -> Result<(), io::Error> {
        std::fs::create_dir(dir)?;
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(dir.join("data"), "payload")?;
        std::fs::write(dir.join("done"), "v2")
    }

    /// Eight threads at once on a stale entry: one builds, the others wait and reuse it; none
    /// fails or sees half an entry. Before the lock (rename onto a removed entry) this failed with
    /// "Directory not empty".
    #[test]
    fn concurrent_fills_build_once() {
        let root = tempfile::tempdir().unwrap();
        let entry = root.path().join("e");
        std::fs::create_dir(&entry).unwrap();
        std::fs::write(entry.join("done"), "v1").unwrap();
        let builds = Arc::new(AtomicUsize::new(0));
        let waits = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (entry, builds, waits, barrier) = (entry.clone(), builds.clone(), waits.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let got = fill_entry(
                        &entry,
                        fresh,
                        |d| {
                            builds.fetch_add(1, Ordering::SeqCst);
                            build(d)
                        },
                        &mut |e| {
                            if e == FillEvent::Waiting {
                                waits.fetch_add(1, Ordering::SeqCst);
                            }
                        },
                    )
                    .unwrap();
                    assert_eq!(std::fs::read_to_string(got.join("data")).unwrap(), "payload");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(builds.load(Ordering::SeqCst), 1);
        let names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().all(|n| n == "e" || n == ".e.lock"),
            "only the entry and its lock: {names:?}"
        );
    }

    /// A killed writer's temp and aside dirs are removed by the next lock holder; another
    /// entry's (`e-x`) are not.
    #[test]
    fn stale_temp_dirs_are_swept() {
        let root = tempfile::tempdir().unwrap();
        for left in [".tmp-e-123", ".old-e-77", ".tmp-e-x-5", ".tmp-e-"] {
            std::fs::create_dir(root.path().join(left)).unwrap();
        }
        std::fs::write(root.path().join(".tmp-e-9"), "a file").unwrap();
        let entry = root.path().join("e");
        fill_entry(&entry, fresh, build, &mut |_| {}).unwrap();
        let mut names: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".e.lock", ".tmp-e-", ".tmp-e-x-5", "e"]);
    }

    /// A fresh entry is returned without taking the lock or building; a failed build leaves the
    /// old entry and no temp dir.
    #[test]
    fn fresh_entries_are_kept_and_failed_builds_clean_up() {
        let root = tempfile::tempdir().unwrap();
        let entry = root.path().join("e");
        fill_entry(&entry, fresh, build, &mut |_| {}).unwrap();
        let mut events = Vec::new();
        fill_entry(
            &entry,
            fresh,
            |_| -> Result<(), io::Error> { panic!("rebuilt") },
            &mut |e| events.push(e),
        )
        .unwrap();
        assert!(events.is_empty());
        std::fs::write(entry.join("done"), "v1").unwrap();
        let err = fill_entry(
            &entry,
            fresh,
            |d| {
                std::fs::create_dir(d)?;
                Err(io::Error::other("no"))
            },
            &mut |e| events.push(e),
        )
        .unwrap_err();
        assert!(matches!(err, FillError::Build(_)), "{err}");
        assert_eq!(events, [FillEvent::Building]);
        assert_eq!(std::fs::read_to_string(entry.join("done")).unwrap(), "v1");
        assert!(!root.path().join(format!(".tmp-e-{}", std::process::id())).exists());
    }

    /// A waiter hears `Waiting`, never `Building`, when the holder builds.
    #[test]
    fn waiters_are_told_they_wait() {
        let root = tempfile::tempdir().unwrap();
        let entry = root.path().join("e");
        let held = lock::<io::Error>(&root.path().join(".e.lock"), &mut |_| {}).unwrap();
        let waiter = {
            let entry = entry.clone();
            std::thread::spawn(move || {
                let mut events = Vec::new();
                fill_entry(&entry, fresh, build, &mut |e| events.push(e)).unwrap();
                events
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        build(&entry).unwrap();
        drop(held);
        assert_eq!(waiter.join().unwrap(), [FillEvent::Waiting]);
    }

    /// A file entry (the model store's GGUF) is replaced whole.
    #[test]
    fn file_entries_are_installed_by_rename() {
        let root = tempfile::tempdir().unwrap();
        let entry = root.path().join("f.gguf");
        std::fs::write(&entry, "old").unwrap();
        let is = |p: &Path| std::fs::read_to_string(p).is_ok_and(|s| s == "new");
        fill_entry(&entry, is, |p| std::fs::write(p, "new"), &mut |_| {}).unwrap();
        assert_eq!(std::fs::read_to_string(&entry).unwrap(), "new");
    }
}
