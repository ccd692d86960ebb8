//! The code point classes llama.cpp's pre-tokenizers use: `\p{L}`, `\p{N}` and `\s`.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

fn letter_ranges() -> &'static [(char, char)] {
    static RANGES: OnceLock<Vec<(char, char)>> = OnceLock::new();
    RANGES.get_or_init(|| {
        let hir = regex_syntax::parse(r"\p{L}").unwrap_or_else(|e| panic!("\\p{{L}} parses: {e}"));
        match hir.kind() {
            HirKind::Class(Class::Unicode(class)) => class.ranges().iter().map(|r| (r.start(), r.end())).collect(),
            other => panic!("\\p{{L}} is a Unicode class, got {other:?}"),
        }
    })
}

/// General category L (Lu, Ll, Lt, Lm, Lo).
pub fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    let ranges = letter_ranges();
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// General category N (Nd, Nl, No).
pub fn is_number(c: char) -> bool {
    c.is_numeric()
}

/// The White_Space property (llama.cpp's whitespace table is the same set).
pub fn is_whitespace(c: char) -> bool {
    c.is_whitespace()
}

/// GPT-2's byte → printable code point map (`bytes_to_unicode`).
pub fn byte_to_char() -> &'static [char; 256] {
    static MAP: OnceLock<[char; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut map = ['\0'; 256];
        let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let mut n = 0;
        for b in 0..256u32 {
            map[b as usize] = if printable(b) {
                char::from_u32(b).unwrap_or('\0')
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap_or('\0')
            };
        }
        map
    })
}
