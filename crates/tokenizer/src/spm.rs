//! llama.cpp's `llm_tokenizer_spm_session`: greedy highest-score bigram merging over UTF-8
//! characters, then re-segmentation of pieces that are not tokens, then byte fallback.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::Tokenizer;

#[derive(Clone, Copy)]
struct Symbol {
    prev: i32,
    next: i32,
    start: usize,
    len: usize,
}

struct Bigram {
    left: i32,
    right: i32,
    score: f32,
    size: usize,
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
    /// The heap's top is the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

/// `utf8_len` of llama.cpp: the sequence length a lead byte announces (1 for stray bytes).
fn utf8_len(b: u8) -> usize {
    const LOOKUP: [usize; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(b >> 4) as usize]
}

/// The byte of a `<0xXX>` token.
pub(crate) fn byte_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

struct Session<'a> {
    vocab: &'a Tokenizer,
    text: &'a [u8],
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Bigram>,
    rev_merge: HashMap<&'a [u8], (i32, i32)>,
}

pub(crate) fn tokenize(vocab: &Tokenizer, text: &str, out: &mut Vec<i32>) {
    let bytes = text.as_bytes();
    let mut s = Session {
        vocab,
        text: bytes,
        symbols: Vec::new(),
        queue: BinaryHeap::new(),
        rev_merge: HashMap::new(),
    };
    let mut offs = 0;
    let mut index = 0i32;
    while offs < bytes.len() {
        let len = utf8_len(bytes[offs]).min(bytes.len() - offs);
        offs += len;
        s.symbols.push(Symbol {
            prev: index - 1,
            next: if offs == bytes.len() { -1 } else { index + 1 },
            start: offs - len,
            len,
        });
        index += 1;
    }
    for i in 1..s.symbols.len() as i32 {
        s.try_add_bigram(i - 1, i);
    }
    while let Some(bigram) = s.queue.pop() {
        let (l, r) = (bigram.left as usize, bigram.right as usize);
        let (left, right) = (s.symbols[l], s.symbols[r]);
        if left.len == 0 || right.len == 0 || left.len + right.len != bigram.size {
            continue;
        }
        s.symbols[l].len += right.len;
        s.symbols[r].len = 0;
        s.symbols[l].next = right.next;
        if right.next >= 0 {
            s.symbols[right.next as usize].prev = bigram.left;
        }
        let prev = s.symbols[l].prev;
        let next = s.symbols[l].next;
        s.try_add_bigram(prev, bigram.left);
        s.try_add_bigram(bigram.left, next);
    }
    let mut i = if s.symbols.is_empty() { -1 } else { 0 };
    while i != -1 {
        let sym = s.symbols[i as usize];
        s.resegment(sym, out);
        i = sym.next;
    }
}

impl<'a> Session<'a> {
    fn piece(&self, start: usize, len: usize) -> &'a [u8] {
        &self.text[start..start + len]
    }

    fn lookup(&self, bytes: &[u8]) -> Option<i32> {
        std::str::from_utf8(bytes).ok().and_then(|t| self.vocab.token_id(t))
    }

    fn try_add_bigram(&mut self, left: i32, right: i32) {
        if left == -1 || right == -1 {
            return;
        }
        let (l, r) = (self.symbols[left as usize], self.symbols[right as usize]);
        let text = self.piece(l.start, l.len + r.len);
        let Some(id) = self.lookup(text) else { return };
        self.queue.push(Bigram {
            left,
            right,
            score: self.vocab.scores[id as usize],
            size: text.len(),
        });
        self.rev_merge.insert(text, (left, right));
    }

    fn resegment(&self, sym: Symbol, out: &mut Vec<i32>) {
        let text = self.piece(sym.start, sym.len);
        if let Some(id) = self.lookup(text) {
            out.push(id);
            return;
        }
        match self.rev_merge.get(text) {
            None => {
                for &b in text {
                    let hex = format!("<0x{b:02X}>");
                    let id = self
                        .vocab
                        .token_id(&hex)
                        .or_else(|| std::str::from_utf8(&[b]).ok().and_then(|c| self.vocab.token_id(c)));
                    // llama.cpp would throw on a vocabulary without byte tokens; we skip the byte.
                    if let Some(id) = id {
                        out.push(id);
                    }
                }
            }
            Some(&(l, r)) => {
                self.resegment(self.symbols[l as usize], out);
                self.resegment(self.symbols[r as usize], out);
            }
        }
    }
}
