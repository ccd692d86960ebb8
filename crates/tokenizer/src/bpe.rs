//! llama.cpp's byte-level BPE: the pre-tokenizer split (`unicode_regex_split` with the custom
//! GPT-2 splitter), GPT-2's byte → code point spelling, then lowest-rank-first merges per word.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

use crate::unicode::{byte_to_char, is_letter, is_number, is_whitespace};
use crate::{PreSplit, Tokenizer};

/// Splits `text` into words (char ranges) the way llama.cpp's pre-tokenizer does.
pub(crate) fn pre_split(text: &str, split: PreSplit) -> Vec<String> {
    let cps: Vec<char> = text.chars().collect();
    let mut offsets = vec![cps.len()];
    offsets = match split {
        PreSplit::Gpt2 => split_gpt2(&cps, &offsets),
        PreSplit::DigitsThenGpt2 => split_gpt2(&cps, &split_each_number(&cps, &offsets)),
        PreSplit::Llama3 => split_llama3(&cps, &offsets, 3),
        PreSplit::Qwen2 => split_llama3(&cps, &offsets, 1),
    };
    let mut words = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for len in offsets {
        words.push(cps[start..start + len].iter().collect());
        start += len;
    }
    words
}

/// The regex `\p{N}`: every number code point becomes its own piece; the gaps are kept.
fn split_each_number(cps: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let mut gap = 0;
        for &c in &cps[start..start + len] {
            if is_number(c) {
                if gap > 0 {
                    out.push(gap);
                    gap = 0;
                }
                out.push(1);
            } else {
                gap += 1;
            }
        }
        if gap > 0 {
            out.push(gap);
        }
        start += len;
    }
    out
}

/// `unicode_regex_split_custom_gpt2`: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
/// within each piece (look-ahead stops at the piece's end).
fn split_gpt2(cps: &[char], offsets: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let (ini, end) = (start, start + len);
        start = end;
        let get = |pos: usize| if pos >= ini && pos < end { Some(cps[pos]) } else { None };
        #[derive(Clone, Copy)]
        struct Flags {
            in_range: bool,
            letter: bool,
            number: bool,
            space: bool,
        }
        let flags = |pos: usize| match get(pos) {
            Some(c) => Flags {
                in_range: true,
                letter: is_letter(c),
                number: is_number(c),
                space: is_whitespace(c),
            },
            None => Flags {
                in_range: false,
                letter: false,
                number: false,
                space: false,
            },
        };
        let mut prev_end = ini;
        let mut add = |to: usize, out: &mut Vec<usize>| -> usize {
            let n = to - prev_end;
            if n > 0 {
                out.push(n);
            }
            prev_end = to;
            n
        };
        let mut pos = ini;
        while pos < end {
            let c = cps[pos];
            let f = flags(pos);
            if c == '\'' && pos + 1 < end {
                let next = get(pos + 1);
                if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                    pos += add(pos + 2, &mut out);
                    continue;
                }
                if pos + 2 < end {
                    let nn = get(pos + 2);
                    if matches!(
                        (next, nn),
                        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                    ) {
                        pos += add(pos + 3, &mut out);
                        continue;
                    }
                }
            }
            let mut f2 = if c == ' ' { flags(pos + 1) } else { f };
            if f2.letter {
                pos += usize::from(c == ' ');
                while f2.letter {
                    pos += 1;
                    f2 = flags(pos);
                }
                add(pos, &mut out);
                continue;
            }
            if f2.number {
                pos += usize::from(c == ' ');
                while f2.number {
                    pos += 1;
                    f2 = flags(pos);
                }
                add(pos, &mut out);
                continue;
            }
            let other = |f: Flags| !(f.space || f.letter || f.number) && f.in_range;
            if other(f2) {
                pos += usize::from(c == ' ');
                while other(f2) {
                    pos += 1;
                    f2 = flags(pos);
                }
                add(pos, &mut out);
                continue;
            }
            let mut spaces = 0;
            while flags(pos + spaces).space {
                spaces += 1;
            }
            pos = spaces_end(pos, spaces, get(pos + spaces).is_some());
            add(pos, &mut out);
        }
    }
    out
}

/// `unicode_regex_split_custom_llama3`, for numbers in runs of at most `digits`:
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
/// within each piece. llama.cpp scans Llama 3's regex by hand and runs Qwen2's (`\p{N}` alone)
/// through `std::regex`; both agree with this scan on the corpus of `tests/data/gen_pre_goldens.py`.
fn split_llama3(cps: &[char], offsets: &[usize], digits: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let (ini, end) = (start, start + len);
        start = end;
        let get = |pos: usize| if pos >= ini && pos < end { Some(cps[pos]) } else { None };
        let letter = |pos: usize| get(pos).is_some_and(is_letter);
        let number = |pos: usize| get(pos).is_some_and(is_number);
        let space = |pos: usize| get(pos).is_some_and(is_whitespace);
        // Neither whitespace, letter nor number, and inside the piece.
        let other = |pos: usize| get(pos).is_some_and(|c| !(is_whitespace(c) || is_letter(c) || is_number(c)));
        let lower = |pos: usize| get(pos).map(|c| c.to_lowercase().next().unwrap_or(c));
        let newline = |c: Option<char>| matches!(c, Some('\r' | '\n'));
        let mut prev_end = ini;
        let mut add = |to: usize, out: &mut Vec<usize>| -> usize {
            let n = to - prev_end;
            if n > 0 {
                out.push(n);
            }
            prev_end = to;
            n
        };
        let mut pos = ini;
        while pos < end {
            let c = cps[pos];
            if c == '\'' && pos + 1 < end {
                let next = lower(pos + 1);
                if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                    pos += add(pos + 2, &mut out);
                    continue;
                }
                if pos + 2 < end
                    && matches!(
                        (next, lower(pos + 2)),
                        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                    )
                {
                    pos += add(pos + 3, &mut out);
                    continue;
                }
            }
            if !(newline(Some(c)) || number(pos)) && (letter(pos) || letter(pos + 1)) {
                pos += 1;
                while letter(pos) {
                    pos += 1;
                }
                add(pos, &mut out);
                continue;
            }
            if number(pos) {
                let mut run = pos;
                while number(pos) {
                    pos += 1;
                    if pos - run >= digits {
                        add(pos, &mut out);
                        run = pos;
                    }
                }
                add(pos, &mut out);
                continue;
            }
            let lead = usize::from(c == ' ');
            if other(pos + lead) {
                pos += lead;
                while other(pos) {
                    pos += 1;
                }
                while newline(get(pos)) {
                    pos += 1;
                }
                add(pos, &mut out);
                continue;
            }
            let mut spaces = 0;
            let mut last_newline_end = None;
            while space(pos + spaces) {
                if newline(get(pos + spaces)) {
                    last_newline_end = Some(pos + spaces + 1);
                }
                spaces += 1;
            }
            pos = match last_newline_end {
                Some(to) => to,
                None => spaces_end(pos, spaces, get(pos + spaces).is_some()),
            };
            add(pos, &mut out);
        }
    }
    out
}

/// The end of the word at `pos` when the splits' other rules did not match: `\s+(?!\S)` (all
/// but the last of `spaces` whitespace characters when more of the piece follows), else `\s+`,
/// else the one character (no match).
fn spaces_end(pos: usize, spaces: usize, more: bool) -> usize {
    if spaces > 1 && more {
        pos + spaces - 1
    } else {
        pos + spaces.max(1)
    }
}

struct Bigram {
    left: i32,
    right: i32,
    text: String,
    rank: u32,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap's top is the lowest rank, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        other.rank.cmp(&self.rank).then(other.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    prev: i32,
    next: i32,
    start: usize,
    len: usize,
}

/// GPT-2's spelling of `text`'s bytes.
fn byte_encode(text: &str) -> String {
    let map = byte_to_char();
    text.bytes().map(|b| map[b as usize]).collect()
}

fn char_to_byte() -> &'static HashMap<char, u8> {
    static MAP: OnceLock<HashMap<char, u8>> = OnceLock::new();
    MAP.get_or_init(|| byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect())
}

/// `llama_decode_text`: GPT-2's code points back to bytes (others kept as UTF-8).
pub(crate) fn decode_text(text: &str) -> Vec<u8> {
    let map = char_to_byte();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => out.extend(c.to_string().as_bytes()),
        }
    }
    out
}

pub(crate) fn tokenize(vocab: &Tokenizer, split: PreSplit, text: &str, out: &mut Vec<i32>) {
    for word in pre_split(text, split) {
        let word = byte_encode(&word);
        // llama.cpp's `ignore_merges` (Llama 3): a word the vocabulary holds whole is that token.
        if split == PreSplit::Llama3 {
            if let Some(id) = vocab.token_id(&word) {
                out.push(id);
                continue;
            }
        }
        let bytes = word.as_bytes();
        let mut symbols: Vec<Symbol> = Vec::new();
        let mut offset = 0;
        let mut index = 0i32;
        while offset < bytes.len() {
            let len = word[offset..].chars().next().map_or(1, char::len_utf8);
            offset += len;
            symbols.push(Symbol {
                prev: index - 1,
                next: if offset == bytes.len() { -1 } else { index + 1 },
                start: offset - len,
                len,
            });
            index += 1;
        }
        let text_of = |s: &Symbol| &word[s.start..s.start + s.len];
        let mut queue = BinaryHeap::new();
        let add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: i32, right: i32| {
            if left == -1 || right == -1 {
                return;
            }
            let (l, r) = (text_of(&symbols[left as usize]), text_of(&symbols[right as usize]));
            if let Some(&rank) = vocab.bpe_ranks.get(&(l.to_string(), r.to_string())) {
                queue.push(Bigram {
                    left,
                    right,
                    text: format!("{l}{r}"),
                    rank,
                });
            }
        };
        for i in 1..symbols.len() as i32 {
            add(&symbols, &mut queue, i - 1, i);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left as usize], symbols[b.right as usize]);
            if l.len == 0 || r.len == 0 {
                continue;
            }
            if l.start + l.len != r.start || word[l.start..r.start + r.len] != b.text {
                continue;
            }
            symbols[b.left as usize].len += r.len;
            symbols[b.right as usize].len = 0;
            symbols[b.left as usize].next = r.next;
            if r.next >= 0 {
                symbols[r.next as usize].prev = b.left;
            }
            let (prev, next) = (symbols[b.left as usize].prev, symbols[b.left as usize].next);
            add(&symbols, &mut queue, prev, b.left);
            add(&symbols, &mut queue, b.left, next);
        }
        for s in symbols.iter().filter(|s| s.len > 0) {
            let piece = text_of(s);
            match vocab.token_id(piece) {
                Some(id) => out.push(id),
                None => {
                    // llama.cpp: each byte of the spelling that is itself a token, the rest dropped.
                    for b in piece.bytes() {
                        if let Some(id) = std::str::from_utf8(&[b]).ok().and_then(|c| vocab.token_id(c)) {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Characters where the splits decide differently: letters, digits of three scripts,
    /// contractions' parts in both cases, every kind of whitespace, marks, punctuation, emoji.
    fn text() -> impl Strategy<Value = String> {
        let chars: Vec<char> = "aZé日ß'sStTrReEvVlLmMdD0123٣٤²Ⅻ !.,-\"\t\n\r\u{a0}\u{3000}\u{301}\u{85}😀"
            .chars()
            .collect();
        proptest::collection::vec(proptest::sample::select(chars), 0..40).prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        /// Every split cuts the text into non-empty words without losing, adding or reordering a
        /// character, and Qwen2's numbers are single digits, Llama 3's runs of at most three.
        #[test]
        fn splits_partition_the_text(text in text()) {
            for split in [PreSplit::Gpt2, PreSplit::DigitsThenGpt2, PreSplit::Llama3, PreSplit::Qwen2] {
                let words = pre_split(&text, split);
                prop_assert_eq!(words.concat(), text.clone(), "{:?}", split);
                prop_assert!(words.iter().all(|w| !w.is_empty()), "{:?}: {:?}", split, words);
                let digits = match split {
                    PreSplit::Qwen2 => 1,
                    PreSplit::Llama3 => 3,
                    _ => continue,
                };
                for w in &words {
                    let n = w.chars().filter(|&c| is_number(c)).count();
                    prop_assert!(n == 0 || n <= digits && w.chars().all(is_number), "{:?}: {:?}", split, w);
                }
            }
        }
    }
}
