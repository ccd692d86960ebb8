//! Automatic prefix caching: a trie of token blocks whose nodes hold KV snapshots.
//!
//! **Exact by construction.** A prompt is always computed in the same pieces, whatever the
//! cache holds: block 0 (`block` ids) by a prefill from position 0, each further whole block by
//! chunk calls after the block before it, and the tail (the ids after the last block boundary
//! that lies strictly before the prompt's end) by the generation call. A cached snapshot at a
//! boundary is the state those very calls left there, so restoring it and running the remaining
//! calls is the cold run minus the calls it skips: the answer is the same id for id. (A cache of
//! arbitrary cut points would not be: a prompt fed as one call and as two calls may round
//! differently.) What the cache changes is only how many of those calls run.
//!
//! The trie's edges are whole blocks (a radix tree whose labels all have one length), so a
//! lookup walks at most `len / block` nodes, hashing one block each. Entries are evicted least
//! recently used first when their estimated bytes pass the budget; a node left without an entry
//! and without children is removed with it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

struct Node<S> {
    parent: usize,
    /// The block on the edge from the parent.
    key: Box<[i32]>,
    children: HashMap<Box<[i32]>, usize>,
    entry: Option<Entry<S>>,
}

struct Entry<S> {
    snapshot: Arc<S>,
    bytes: usize,
    stamp: u64,
}

/// What [`PrefixCache::longest`] found.
pub struct Hit<S> {
    /// Positions the snapshot holds (a multiple of the block; 0 with no snapshot).
    pub positions: usize,
    pub snapshot: Option<Arc<S>>,
}

/// Token-prefix → snapshot map with a byte budget. `S` is a backend's snapshot; the cache lives
/// on the thread that owns the backend.
pub struct PrefixCache<S> {
    block: usize,
    budget: usize,
    /// Estimated bytes of a snapshot at a position.
    cost: Box<dyn Fn(usize) -> usize + Send>,
    nodes: Vec<Node<S>>,
    free: Vec<usize>,
    /// Entries by last use (stamps are unique).
    lru: BTreeMap<u64, usize>,
    clock: u64,
    bytes: usize,
    evictions: u64,
}

const ROOT: usize = 0;

impl<S> PrefixCache<S> {
    /// A cache of snapshots at multiples of `block` ids, within `budget` estimated bytes
    /// (`cost(position)`); a budget of 0 keeps nothing.
    pub fn new(block: usize, budget: usize, cost: impl Fn(usize) -> usize + Send + 'static) -> Self {
        PrefixCache {
            block: block.max(1),
            budget,
            cost: Box::new(cost),
            nodes: vec![Node {
                parent: ROOT,
                key: Box::new([]),
                children: HashMap::new(),
                entry: None,
            }],
            free: Vec::new(),
            lru: BTreeMap::new(),
            clock: 0,
            bytes: 0,
            evictions: 0,
        }
    }

    pub fn block(&self) -> usize {
        self.block
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub fn entries(&self) -> usize {
        self.lru.len()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The boundary the tail of a prompt of `len` ids starts at: the last multiple of the block
    /// strictly below `len`, so that the tail holds at least one id (the generation call needs
    /// one to predict from).
    pub fn boundary(&self, len: usize) -> usize {
        len.saturating_sub(1) / self.block * self.block
    }

    /// The deepest snapshot whose ids are a prefix of `ids` (whole blocks of it only), marked as
    /// used now.
    pub fn longest(&mut self, ids: &[i32]) -> Hit<S> {
        let mut node = ROOT;
        let mut best = (0, None);
        for (i, block) in ids.chunks_exact(self.block).enumerate() {
            match self.nodes[node].children.get(block) {
                Some(&child) => node = child,
                None => break,
            }
            if self.nodes[node].entry.is_some() {
                best = ((i + 1) * self.block, Some(node));
            }
        }
        let (positions, node) = best;
        let snapshot = node.map(|n| {
            self.touch(n);
            self.nodes[n]
                .entry
                .as_ref()
                .map(|e| e.snapshot.clone())
                .unwrap_or_else(|| unreachable!("the walk kept only nodes with entries"))
        });
        Hit { positions, snapshot }
    }

    fn touch(&mut self, node: usize) {
        self.clock += 1;
        let stamp = self.clock;
        if let Some(entry) = self.nodes[node].entry.as_mut() {
            self.lru.remove(&entry.stamp);
            entry.stamp = stamp;
            self.lru.insert(stamp, node);
        }
    }

    /// Keeps `snapshot` as the state after `ids` (a whole number of blocks), evicting the least
    /// recently used entries beyond the budget; the snapshot is handed back shared. A snapshot
    /// larger than the whole budget is not kept.
    pub fn insert(&mut self, ids: &[i32], snapshot: S) -> Arc<S> {
        let snapshot = Arc::new(snapshot);
        debug_assert_eq!(ids.len() % self.block, 0, "snapshots are kept at block boundaries");
        let bytes = (self.cost)(ids.len());
        if ids.is_empty() || bytes > self.budget {
            return snapshot;
        }
        let mut node = ROOT;
        for block in ids.chunks_exact(self.block) {
            node = match self.nodes[node].children.get(block) {
                Some(&child) => child,
                None => {
                    let child = self.alloc(node, block);
                    self.nodes[node].children.insert(block.into(), child);
                    child
                }
            };
        }
        if let Some(old) = self.nodes[node].entry.take() {
            self.lru.remove(&old.stamp);
            self.bytes -= old.bytes;
        }
        self.clock += 1;
        self.nodes[node].entry = Some(Entry {
            snapshot: snapshot.clone(),
            bytes,
            stamp: self.clock,
        });
        self.lru.insert(self.clock, node);
        self.bytes += bytes;
        while self.bytes > self.budget {
            let Some((_, victim)) = self.lru.pop_first() else { break };
            self.evict(victim);
        }
        snapshot
    }

    fn alloc(&mut self, parent: usize, key: &[i32]) -> usize {
        let node = Node {
            parent,
            key: key.into(),
            children: HashMap::new(),
            entry: None,
        };
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Drops `node`'s entry (already out of the LRU order) and every node left empty above it.
    fn evict(&mut self, node: usize) {
        if let Some(entry) = self.nodes[node].entry.take() {
            self.bytes -= entry.bytes;
            self.evictions += 1;
        }
        let mut at = node;
        while at != ROOT && self.nodes[at].entry.is_none() && self.nodes[at].children.is_empty() {
            let parent = self.nodes[at].parent;
            let key = std::mem::take(&mut self.nodes[at].key);
            self.nodes[parent].children.remove(&key);
            self.free.push(at);
            at = parent;
        }
    }

    /// Nodes in use (the root included): for tests of the pruning.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize, salt: i32) -> Vec<i32> {
        (0..n as i32).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn finds_the_deepest_block_boundary_of_a_shared_prefix() {
        let mut c: PrefixCache<usize> = PrefixCache::new(4, 1000, |p| p);
        let a = ids(12, 0);
        c.insert(&a[..4], 4);
        c.insert(&a[..8], 8);
        let hit = c.longest(&a);
        assert_eq!((hit.positions, hit.snapshot.as_deref()), (8, Some(&8)));
        // Sharing 6 ids: only the first block.
        let mut b = a.clone();
        b[6] = -1;
        let hit = c.longest(&b);
        assert_eq!((hit.positions, hit.snapshot.as_deref()), (4, Some(&4)));
        // Differing in the first id: nothing.
        b[0] = -1;
        assert_eq!(c.longest(&b).positions, 0);
        assert_eq!(c.boundary(8), 4, "a prompt of exactly two blocks feeds its last block");
        assert_eq!(c.boundary(9), 8);
        assert_eq!(c.boundary(0), 0);
    }

    #[test]
    fn evicts_least_recently_used_and_prunes_empty_nodes() {
        // Budget for 16 positions' worth.
        let mut c: PrefixCache<usize> = PrefixCache::new(4, 16, |p| p);
        let a = ids(8, 0);
        let b = ids(8, 1000);
        c.insert(&a[..4], 1);
        c.insert(&a[..8], 2);
        assert_eq!(c.bytes(), 12);
        // Using the first entry makes the second the oldest.
        assert_eq!(c.longest(&a[..4]).positions, 4);
        c.insert(&b[..8], 3);
        assert_eq!(c.evictions(), 1);
        assert_eq!(c.longest(&a).positions, 4, "a[..8] was the least recently used");
        assert_eq!(c.bytes(), 12);
        // b[..8]'s path has an empty inner node; evicting its entry removes both.
        c.insert(&a[..8], 4);
        assert_eq!(c.longest(&b).positions, 0);
        assert_eq!(c.nodes(), 3, "root and a's two blocks");
        // Larger than the budget: not kept, nothing evicted for it.
        let big = ids(20, 5);
        c.insert(&big, 9);
        assert_eq!(c.longest(&big).positions, 0);
        assert_eq!(c.entries(), 2);
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let mut c: PrefixCache<usize> = PrefixCache::new(4, 0, |p| p);
        c.insert(&ids(4, 0), 1);
        assert!(!c.enabled());
        assert_eq!(c.entries(), 0);
        assert_eq!(c.longest(&ids(8, 0)).positions, 0);
    }
}
