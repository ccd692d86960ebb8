//! Shared printing helpers.

use std::time::Duration;

pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

pub fn ids_to_string(ids: &[i32]) -> String {
    ids.iter().map(i32::to_string).collect::<Vec<_>>().join(",")
}

/// Parses `1,2,3` (spaces allowed) into ids; the error names the bad item.
pub fn parse_ids(text: &str) -> Result<Vec<i32>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<i32>().map_err(|_| format!("`{s}` is not a token id")))
        .collect()
}

/// Stdout refused a write: a closed pipe (`| head -c 10`) or a full disk (`> /dev/full`).
/// Its own type, so that `main` ends quietly on a closed stdout and on nothing else (a pipe to
/// a child process that breaks is a real error).
#[derive(Debug)]
pub struct StdoutError(pub std::io::Error);

impl std::fmt::Display for StdoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("writing to stdout")
    }
}

impl std::error::Error for StdoutError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl StdoutError {
    pub fn is_closed(&self) -> bool {
        self.0.kind() == std::io::ErrorKind::BrokenPipe
    }
}

/// Writes to stdout and flushes, returning what `println!` panics on (exit 101, "internal
/// bug"). Flushed each time so that the error comes from this call, not from exit.
pub fn write_stdout(args: std::fmt::Arguments) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(|e| StdoutError(e).into())
}

/// `println!` that returns the write's error (see [`write_stdout`]): `outln!(...)?`.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::report::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::report::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// The error and its causes on one line, each cause once: library errors put their source's
/// text in their own message (the JNI shows one line too) and also chain it as `source`, so
/// anyhow's `{:#}` printed OS errors twice ("...: No such file or directory (os error 2): No such
/// file or directory (os error 2)").
pub fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Whether `error` is stdout closed under us (EPIPE), which ends the command quietly.
pub fn is_closed_stdout(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|e| e.downcast_ref::<StdoutError>().is_some_and(StdoutError::is_closed))
}

/// The exit status of a command whose stdout was closed: what a shell reports for a process
/// ended by SIGPIPE (128 + 13), without dying of the signal.
pub const CLOSED_STDOUT_EXIT: u8 = 141;

/// `N tokens in T s (X tokens/s)`: the summary `generate` and `chat` print on stderr after text.
pub fn rate_line(tokens: usize, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    let rate = if secs > 0.0 { tokens as f64 / secs } else { 0.0 };
    format!("{tokens} tokens in {secs:.2} s ({rate:.1} tokens/s)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let text = io.to_string();
        let error = anyhow::Error::new(kv_core::Error::Io {
            what: "opening snapshot",
            path: "/x".into(),
            source: io,
        })
        .context("reading /x");
        let line = one_line(&error);
        assert_eq!(line.matches(&text).count(), 1, "{line}");
        assert_eq!(line, format!("reading /x: opening snapshot /x: {text}"));
    }
}
