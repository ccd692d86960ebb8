//! The set of token ids a constrained decoder allows next (a grammar's mask).
//!
//! One bit per vocabulary id, packed little-endian into `u32` words exactly as the v2 graphs
//! take it (`i32[ceil(vocab/32)]`, bit `id % 32` of word `id / 32`), so the same words go to a
//! device without conversion. llguidance's `SimpleVob` uses the same packing.

use crate::error::{Error, Result};

/// # Example
///
/// ```
/// use kv_core::allowed::AllowedTokens;
///
/// let mut allowed = AllowedTokens::from_ids(100, &[3, 40, 41]).unwrap();
/// allowed.insert(99).unwrap();
/// assert!(allowed.allows(40) && !allowed.allows(4));
/// // ceil(100 / 32) words; id 40 is bit 8 of word 1.
/// assert_eq!(allowed.words(), &[1 << 3, 1 << 8 | 1 << 9, 0, 1 << 3]);
/// let mut logits = vec![0.0f32; 100];
/// logits[7] = 9.0; // the best, but not allowed
/// logits[41] = 2.0;
/// assert_eq!(allowed.argmax(&logits), Some(41));
/// allowed.mask_logits(&mut logits);
/// assert_eq!(logits[7], f32::NEG_INFINITY);
/// assert!(AllowedTokens::from_ids(100, &[100]).is_err()); // outside the vocabulary
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedTokens {
    vocab: usize,
    words: Vec<u32>,
}

impl AllowedTokens {
    /// Words needed for `vocab` ids.
    pub fn words_for(vocab: usize) -> usize {
        vocab.div_ceil(32)
    }

    /// Every id of the vocabulary allowed.
    pub fn all(vocab: usize) -> Self {
        let mut words = vec![u32::MAX; Self::words_for(vocab)];
        if vocab % 32 != 0 {
            if let Some(last) = words.last_mut() {
                *last = (1u32 << (vocab % 32)) - 1;
            }
        }
        AllowedTokens { vocab, words }
    }

    /// No id allowed (a start to add to).
    pub fn none(vocab: usize) -> Self {
        AllowedTokens {
            vocab,
            words: vec![0; Self::words_for(vocab)],
        }
    }

    /// Exactly `ids`; an id outside `0..vocab` is [`Error::TokenOutOfRange`].
    pub fn from_ids(vocab: usize, ids: &[i32]) -> Result<Self> {
        let mut set = Self::none(vocab);
        for &id in ids {
            set.insert(id)?;
        }
        Ok(set)
    }

    /// Takes packed words as a grammar engine hands them; bits past `vocab` are cleared, a wrong
    /// word count is [`Error::BadTokenCount`].
    pub fn from_words(vocab: usize, mut words: Vec<u32>) -> Result<Self> {
        let want = Self::words_for(vocab);
        if words.len() != want {
            return Err(Error::BadTokenCount {
                op: "allowed tokens (u32 words)",
                n: words.len(),
                min: want,
                max: want,
            });
        }
        if vocab % 32 != 0 {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (vocab % 32)) - 1;
            }
        }
        Ok(AllowedTokens { vocab, words })
    }

    pub fn insert(&mut self, id: i32) -> Result<()> {
        let i = self.index(id).ok_or(Error::TokenOutOfRange {
            op: "allowed tokens",
            index: 0,
            id: id.into(),
            vocab: self.vocab,
        })?;
        self.words[i / 32] |= 1 << (i % 32);
        Ok(())
    }

    fn index(&self, id: i32) -> Option<usize> {
        usize::try_from(id).ok().filter(|&i| i < self.vocab)
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// A mask built for another vocabulary than a backend's `vocab` is [`Error::BadTokenCount`]
    /// (`set_allowed` of every backend checks this before it changes anything).
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        if self.vocab != vocab {
            return Err(Error::BadTokenCount {
                op: "set_allowed (mask vocabulary)",
                n: self.vocab,
                min: vocab,
                max: vocab,
            });
        }
        Ok(())
    }

    /// The packed words (see the module doc for the layout).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Whether `id` is allowed; ids outside the vocabulary never are.
    pub fn allows(&self, id: i32) -> bool {
        self.index(id)
            .is_some_and(|i| self.words[i / 32] & (1 << (i % 32)) != 0)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Every id allowed: a backend skips the mask (and its upload) altogether.
    pub fn is_all(&self) -> bool {
        self.count() == self.vocab
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The allowed ids, ascending.
    pub fn ids(&self) -> impl Iterator<Item = i32> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &bits)| {
            (0..32)
                .filter(move |b| bits & (1 << b) != 0)
                .map(move |b| (w * 32 + b) as i32)
        })
    }

    /// Sets every disallowed logit to `-inf`, as the graphs do before their argmax and top-k.
    /// `logits` longer than the vocabulary (padded heads) have their tail disallowed too.
    pub fn mask_logits(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= self.vocab || self.words[i / 32] & (1 << (i % 32)) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// The allowed id of the largest logit, lowest id first on ties (the graphs' argmax rule);
    /// `None` when nothing is allowed.
    pub fn argmax(&self, logits: &[f32]) -> Option<i32> {
        let mut best: Option<(usize, f32)> = None;
        for i in self.ids().map(|id| id as usize).take_while(|&i| i < logits.len()) {
            let l = logits[i];
            if best.is_none_or(|(_, b)| l > b) {
                best = Some((i, l));
            }
        }
        best.map(|(i, _)| i as i32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_matches_the_graph_layout() {
        let set = AllowedTokens::from_ids(70, &[0, 31, 32, 69]).unwrap();
        assert_eq!(set.words(), &[1 | 1 << 31, 1, 1 << 5]);
        assert_eq!(set.ids().collect::<Vec<_>>(), vec![0, 31, 32, 69]);
        assert_eq!(set.count(), 4);
        assert!(set.allows(32) && !set.allows(33) && !set.allows(70) && !set.allows(-1));
    }

    #[test]
    fn all_covers_exactly_the_vocabulary() {
        for vocab in [1, 31, 32, 33, 64, 262_144] {
            let all = AllowedTokens::all(vocab);
            assert_eq!(all.count(), vocab, "vocab {vocab}");
            assert!(all.is_all());
            assert!(!AllowedTokens::none(vocab).is_all());
        }
    }

    #[test]
    fn words_past_the_vocabulary_are_cleared_and_counts_checked() {
        let set = AllowedTokens::from_words(33, vec![0, u32::MAX]).unwrap();
        assert_eq!(set.ids().collect::<Vec<_>>(), vec![32]);
        assert!(matches!(
            AllowedTokens::from_words(33, vec![0]),
            Err(Error::BadTokenCount { n: 1, .. })
        ));
        assert!(matches!(
            AllowedTokens::from_ids(8, &[8]),
            Err(Error::TokenOutOfRange { id: 8, vocab: 8, .. })
        ));
    }

    #[test]
    fn argmax_takes_the_best_allowed_lowest_id_on_ties() {
        let logits = [5.0, 1.0, 3.0, 3.0, 9.0];
        let set = AllowedTokens::from_ids(5, &[1, 2, 3]).unwrap();
        assert_eq!(set.argmax(&logits), Some(2));
        assert_eq!(AllowedTokens::none(5).argmax(&logits), None);
        let mut masked = logits;
        set.mask_logits(&mut masked);
        assert_eq!(masked, [f32::NEG_INFINITY, 1.0, 3.0, 3.0, f32::NEG_INFINITY]);
    }
}
