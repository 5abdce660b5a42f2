//! The prefix cache: full KV blocks of finished sequences, kept so a later prompt that starts
//! with the same tokens reuses them instead of computing them again.
//!
//! A block is named by a hash chained over every token up to its end (so equal tokens at
//! different depths are different blocks); each entry also keeps its tokens and its parent's
//! key, so a hash collision can never hand out the wrong KV. The cache holds one pool reference
//! per entry. An entry no sequence is using is evictable, least recently used first (a lookup
//! touches the deepest block first, so leaves go before the prefixes they extend).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use trellm_model::BlockPool;

const ROOT: u64 = 0x7472_656c_6c6d_0001;

struct Entry {
    block: u32,
    parent: u64,
    tokens: Box<[u32]>,
    last_used: u64,
}

#[derive(Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    clock: u64,
}

fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// Blocks the cache holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The blocks holding the longest cached prefix of `tokens`, at most `max_blocks` of them
    /// (the caller takes its own references).
    pub fn lookup(&mut self, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<u32> {
        let mut key = ROOT;
        let mut found = Vec::new();
        for t in tokens.chunks_exact(block_size).take(max_blocks) {
            let k = chain(key, t);
            match self.entries.get(&k) {
                Some(e) if e.parent == key && *e.tokens == *t => {
                    found.push(k);
                    key = k;
                }
                _ => break,
            }
        }
        for k in found.iter().rev() {
            self.clock += 1;
            self.entries.get_mut(k).expect("just found").last_used = self.clock;
        }
        found.iter().map(|k| self.entries[k].block).collect()
    }

    /// Offers the full blocks of a sequence whose first `tokens.len()` positions are in
    /// `blocks`; blocks already cached under the same tokens are skipped.
    pub fn insert(&mut self, pool: &mut BlockPool, tokens: &[u32], blocks: &[u32]) {
        let bs = pool.block_size();
        let mut key = ROOT;
        for (t, &b) in tokens.chunks_exact(bs).zip(blocks) {
            let k = chain(key, t);
            self.clock += 1;
            match self.entries.get_mut(&k) {
                Some(e) if e.parent == key && *e.tokens == *t => e.last_used = self.clock,
                // A hash collision with another chain: keep the entry there, stop here.
                Some(_) => return,
                None => {
                    pool.retain(b);
                    self.entries.insert(
                        k,
                        Entry {
                            block: b,
                            parent: key,
                            tokens: t.into(),
                            last_used: self.clock,
                        },
                    );
                }
            }
            key = k;
        }
    }

    /// Entries only the cache holds (their blocks return to the pool when evicted).
    pub fn evictable(&self, pool: &BlockPool) -> usize {
        self.entries
            .values()
            .filter(|e| pool.holders(e.block) == 1)
            .count()
    }

    /// Frees up to `n` blocks, least recently used first; returns how many.
    pub fn evict(&mut self, pool: &mut BlockPool, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let mut idle: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| pool.holders(e.block) == 1)
            .map(|(&k, e)| (e.last_used, k))
            .collect();
        idle.sort_unstable();
        let mut freed = 0;
        for (_, k) in idle.into_iter().take(n) {
            let e = self.entries.remove(&k).expect("listed");
            pool.release_block(e.block);
            freed += 1;
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_the_longest_prefix_and_evicts_idle_blocks_lru() {
        let mut pool = BlockPool::new(8, 2);
        let mut t = trellm_model::BlockTable::default();
        pool.grow(&mut t, 6).unwrap();
        let tokens = [1, 2, 3, 4, 5, 6];
        let mut cache = PrefixCache::default();
        cache.insert(&mut pool, &tokens, t.blocks());
        let blocks = t.blocks().to_vec();
        pool.release(t);
        assert_eq!(cache.len(), 3);
        assert_eq!(pool.free_blocks(), 5);
        // Same start, different third block; at most two blocks asked for.
        assert_eq!(cache.lookup(&[1, 2, 3, 4, 9, 9], 2, 8), blocks[..2]);
        assert_eq!(cache.lookup(&tokens, 2, 2), blocks[..2]);
        // Equal tokens at another depth are not the same block.
        assert!(cache.lookup(&[3, 4], 2, 8).is_empty());
        // A sequence using the first block pins it.
        let user = pool.share(&blocks[..1]);
        assert_eq!(cache.evictable(&pool), 2);
        // The deepest idle block goes first.
        assert_eq!(cache.evict(&mut pool, 1), 1);
        assert_eq!(cache.lookup(&tokens, 2, 8), blocks[..2]);
        assert_eq!(cache.evict(&mut pool, 8), 1);
        assert_eq!(cache.len(), 1);
        pool.release(user);
        assert_eq!(cache.evict(&mut pool, 8), 1);
        assert_eq!(pool.free_blocks(), 8);
    }
}
