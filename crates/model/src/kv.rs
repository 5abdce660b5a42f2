//! Paged KV cache bookkeeping, the same on every backend: fixed-size blocks handed out from a
//! pool, a block table per sequence, reference counts so a fork shares its parent's blocks, and
//! copy-on-write when a shared block is extended. The backend stores the blocks' contents.

use std::fmt;

/// The pool has too few free blocks for a request; the caller can wait, evict or refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFull {
    pub needed: usize,
    pub free: usize,
}

impl fmt::Display for PoolFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the KV cache is full: {} blocks needed, {} free",
            self.needed, self.free
        )
    }
}

impl std::error::Error for PoolFull {}

/// One sequence's blocks and the positions they hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
    len: usize,
}

impl BlockTable {
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Tables holding each block (0: free).
    refs: Vec<u32>,
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(n_blocks: usize, block_size: usize) -> BlockPool {
        assert!(block_size > 0, "a KV block holds at least one position");
        assert!(n_blocks <= u32::MAX as usize, "block ids are u32");
        BlockPool {
            block_size,
            refs: vec![0; n_blocks],
            // Popped from the back: low ids first.
            free: (0..n_blocks as u32).rev().collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn total_blocks(&self) -> usize {
        self.refs.len()
    }
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks a sequence of `len` positions occupies.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// Free blocks `t` needs to hold `new_len` positions: new blocks, plus a copy of its last
    /// block if that one is shared and will be written.
    pub fn needed(&self, t: &BlockTable, new_len: usize) -> usize {
        if new_len <= t.len {
            return 0;
        }
        let grow = self.blocks_for(new_len) - t.blocks.len();
        let cow = !t.len.is_multiple_of(self.block_size)
            && self.refs[*t.blocks.last().expect("a partial block exists") as usize] > 1;
        grow + cow as usize
    }

    /// Makes room in `t` for `new_len` positions. Returns the `(src, dst)` block copies the
    /// backend must make before the step writes (a shared last block is copied, then owned).
    /// Nothing changes when the pool cannot supply the blocks.
    pub fn grow(
        &mut self,
        t: &mut BlockTable,
        new_len: usize,
    ) -> Result<Vec<(u32, u32)>, PoolFull> {
        let needed = self.needed(t, new_len);
        if needed > self.free.len() {
            return Err(PoolFull {
                needed,
                free: self.free.len(),
            });
        }
        let mut copies = Vec::new();
        if new_len > t.len && !t.len.is_multiple_of(self.block_size) {
            let last = t.blocks.last_mut().expect("a partial block exists");
            if self.refs[*last as usize] > 1 {
                let fresh = self.take();
                self.refs[*last as usize] -= 1;
                copies.push((*last, fresh));
                *last = fresh;
            }
        }
        while t.blocks.len() < self.blocks_for(new_len) {
            let b = self.take();
            t.blocks.push(b);
        }
        t.len = t.len.max(new_len);
        Ok(copies)
    }

    fn take(&mut self) -> u32 {
        let b = self.free.pop().expect("availability checked by the caller");
        self.refs[b as usize] = 1;
        b
    }

    /// A new table sharing every block of `t` (a common prefix); either may then be extended.
    pub fn fork(&mut self, t: &BlockTable) -> BlockTable {
        for &b in &t.blocks {
            self.refs[b as usize] += 1;
        }
        BlockTable {
            blocks: t.blocks.clone(),
            len: t.len,
        }
    }

    /// A table over `blocks` (full blocks someone else holds, e.g. a cached prompt prefix),
    /// sharing them.
    pub fn share(&mut self, blocks: &[u32]) -> BlockTable {
        for &b in blocks {
            self.retain(b);
        }
        BlockTable {
            blocks: blocks.to_vec(),
            len: blocks.len() * self.block_size,
        }
    }

    /// One more holder of block `b` (which must be in use).
    pub fn retain(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        assert!(*r > 0, "retaining a free block");
        *r += 1;
    }

    /// One holder fewer of block `b`; it returns to the pool when none is left.
    pub fn release_block(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// How many tables (or other holders) hold block `b`.
    pub fn holders(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// Gives `t`'s blocks back (each returns to the pool when no table holds it).
    pub fn release(&mut self, t: BlockTable) {
        for b in t.blocks {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
    }

    /// Keeps only the first `len` positions of `t` (blocks past them are released).
    pub fn truncate(&mut self, t: &mut BlockTable, len: usize) {
        if len >= t.len {
            return;
        }
        let keep = self.blocks_for(len);
        for b in t.blocks.drain(keep..) {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
            }
        }
        t.len = len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_fork_copy_on_write_release() {
        let mut p = BlockPool::new(4, 4);
        let mut a = BlockTable::default();
        assert!(p.grow(&mut a, 6).unwrap().is_empty());
        assert_eq!(a.blocks(), &[0, 1]);
        assert_eq!(p.free_blocks(), 2);
        let mut b = p.fork(&a);
        // b writes position 6, inside the shared partial block 1: it gets its own copy.
        assert_eq!(p.needed(&b, 7), 1);
        assert_eq!(p.grow(&mut b, 7).unwrap(), vec![(1, 2)]);
        assert_eq!(b.blocks(), &[0, 2]);
        // a's block 1 is its own again: no copy.
        assert!(p.grow(&mut a, 8).unwrap().is_empty());
        assert_eq!(p.free_blocks(), 1);
        // Too much: an error, nothing changed.
        let err = p.grow(&mut a, 20).unwrap_err();
        assert_eq!((err.needed, err.free), (3, 1));
        assert_eq!((a.len(), a.blocks().len()), (8, 2));
        p.release(a);
        assert_eq!(p.free_blocks(), 2); // block 0 is still b's
        p.release(b);
        assert_eq!(p.free_blocks(), 4);
    }

    #[test]
    fn fork_at_block_boundary_shares_without_copy() {
        let mut p = BlockPool::new(3, 2);
        let mut a = BlockTable::default();
        p.grow(&mut a, 2).unwrap();
        let mut b = p.fork(&a);
        assert!(p.grow(&mut b, 3).unwrap().is_empty());
        assert_eq!(b.blocks(), &[0, 1]);
        p.truncate(&mut b, 1);
        assert_eq!((b.len(), b.blocks()), (1, &[0][..]));
        assert_eq!(p.free_blocks(), 2);
    }
}
