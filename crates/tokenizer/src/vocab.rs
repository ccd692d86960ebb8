//! Every token's text in one buffer, and an index from text to id that stores ids only.
//!
//! Gemma 3's vocabulary has 262,144 tokens. As a `Vec<String>` plus a `HashMap<String, i32>`
//! holding a second copy of every text it took ~35 MB of heap for ~4 MB of text (two
//! allocations and three words per token, a table of `(String, i32)` entries); here it is the
//! text, one `u32` end offset per token and a table of `u32` ids hashed by their text.

use std::hash::{BuildHasher, RandomState};

use hashbrown::HashTable;

#[derive(Clone, Debug)]
pub(crate) struct Vocab {
    text: String,
    /// `ends[i]`: where token `i`'s text ends in `text` (it starts where token `i - 1`'s ends).
    ends: Vec<u32>,
    by_text: HashTable<u32>,
    hasher: RandomState,
}

impl Vocab {
    /// The tokens in id order. A text that occurs twice maps to its last id (as the map this
    /// replaces did); `None` if the texts do not fit `u32` offsets.
    pub(crate) fn new<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Option<Vocab> {
        let tokens = tokens.into_iter();
        let mut text = String::new();
        let mut ends = Vec::with_capacity(tokens.size_hint().0);
        for t in tokens {
            text.push_str(t);
            ends.push(u32::try_from(text.len()).ok()?);
        }
        text.shrink_to_fit();
        let hasher = RandomState::new();
        let hash_of = |id: u32| hasher.hash_one(slice(&text, &ends, id as usize).unwrap_or_default());
        let mut by_text = HashTable::with_capacity(ends.len());
        for id in 0..ends.len() as u32 {
            let token = slice(&text, &ends, id as usize).unwrap_or_default();
            let same = |&other: &u32| slice(&text, &ends, other as usize) == Some(token);
            match by_text.find_mut(hash_of(id), same) {
                Some(slot) => *slot = id,
                None => {
                    by_text.insert_unique(hash_of(id), id, |&other| hash_of(other));
                }
            }
        }
        Some(Vocab {
            text,
            ends,
            by_text,
            hasher,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Token `id`'s text.
    pub(crate) fn get(&self, id: usize) -> Option<&str> {
        slice(&self.text, &self.ends, id)
    }

    /// The id of the token whose text is `text`.
    pub(crate) fn id(&self, text: &str) -> Option<i32> {
        let hash = self.hasher.hash_one(text);
        self.by_text
            .find(hash, |&id| self.get(id as usize) == Some(text))
            .map(|&id| id as i32)
    }
}

fn slice<'a>(text: &'a str, ends: &[u32], id: usize) -> Option<&'a str> {
    let end = *ends.get(id)? as usize;
    let start = if id == 0 { 0 } else { ends[id - 1] as usize };
    text.get(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_and_ids_round_trip_and_a_repeated_text_maps_to_its_last_id() {
        let v = Vocab::new(["<pad>", "", "a", "ab", "▁the", "a", "é"]).unwrap();
        assert_eq!(v.len(), 7);
        for (id, t) in ["<pad>", "", "a", "ab", "▁the", "a", "é"].iter().enumerate() {
            assert_eq!(v.get(id), Some(*t));
        }
        assert_eq!(v.get(7), None);
        assert_eq!(v.id("a"), Some(5));
        assert_eq!(v.id("ab"), Some(3));
        assert_eq!(v.id(""), Some(1));
        assert_eq!(v.id("é"), Some(6));
        assert_eq!(v.id("b"), None);
        assert_eq!(v.id("▁th"), None);
    }
}
