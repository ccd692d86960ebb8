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
