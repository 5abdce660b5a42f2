//! The EXL3 tile encoder: a tail-biting Viterbi search over the 2^16-state bitshift trellis,
//! the inverse of [`super::trellis::decode_tile`].
//!
//! A tile is 256 positions; position `p`'s state is `s_p = ((s_{p-1} << K) | sym_p) & 0xFFFF`
//! and it decodes to `codebook(s_p)`. Consecutive states share an *edge*, the low `16 - K` bits
//! of `s_{p-1}` (= the high bits of `s_p`), so the search keeps one best cost per edge
//! (2^(16-K) of them) and each step tries the 2^K states that end in each edge: 2^16 squared
//! errors per position, whatever K.
//!
//! The stream is circular (the first state's high bits are the last positions' symbols). Two
//! passes make the result a valid circular stream: the first runs unconstrained on the tile
//! rolled by 128 positions, and the edge its best path crosses between positions 255 and 0
//! becomes the forced start and end of the second, which is the exact optimum among streams
//! with that edge. Costs are f32 sums in position order, so the reported cost is bit-equal to
//! the squared error of the decoded tile summed the same way.

use rayon::prelude::*;

use super::codebook::{self, Codebook};
use super::simd::Level;
use super::trellis::POSITION_INDEX;

/// One encoded tile.
#[derive(Clone, Debug)]
pub struct EncodedTile {
    /// The stream as the `trellis` tensor stores it (`16 K` int16 words, little-endian bytes).
    pub bytes: Vec<u8>,
    /// The decoded values, row-major `[in 16][out 16]` (what [`super::trellis::decode_tile_f32`]
    /// gives back from `bytes`).
    pub values: [f32; 256],
    /// Sum over positions, in position order, of the squared error (f32).
    pub cost: f32,
}

/// Working memory of one search; reuse it across tiles (it is up to 8 MiB at K = 1).
pub struct Scratch {
    k: u32,
    /// Back-pointers: per step and edge, the high K bits of the best state ending in it.
    bp: Vec<u8>,
    /// Costs per edge, padded by 16 so vector loads past the end stay in bounds.
    cost: Vec<f32>,
    next: Vec<f32>,
    /// Back-pointers of the steps nobody traces back.
    spare: Vec<u8>,
}

impl Scratch {
    pub fn new(k: u32) -> Self {
        assert!((1..=8).contains(&k), "K must be 1..=8");
        let edges = 1usize << (16 - k);
        Scratch {
            k,
            bp: vec![0; 256 * edges],
            cost: vec![0.0; edges + 16],
            next: vec![0.0; edges + 16],
            spare: vec![0; edges],
        }
    }
}

/// One trellis step: for every edge `o`, the best of the 2^K states `(c << (16-K)) | o`, each
/// costing `prev[state >> K] + (value(state) - w)^2` (first minimum wins). Writes `next` and
/// the back-pointers `bp` (one byte per edge).
fn step_scalar(
    k: u32,
    table: &[f32; 65536],
    prev: &[f32],
    next: &mut [f32],
    bp: &mut [u8],
    w: f32,
) {
    let kr = 16 - k;
    let edges = 1usize << kr;
    for o in 0..edges {
        let (mut best, mut bk) = (f32::INFINITY, 0u8);
        for c in 0..1usize << k {
            let s = (c << kr) | o;
            let d = table[s] - w;
            let cost = prev[s >> k] + d * d;
            if cost < best {
                best = cost;
                bk = c as u8;
            }
        }
        next[o] = best;
        bp[o] = bk;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::step_scalar`] on 64 edges at a time (four independent 16-lane chains, so the
    /// compare/select latency overlaps): the 16 states of one candidate `c` are consecutive in
    /// the table; their previous edges are `16 >> K` consecutive costs, each repeated 2^K times
    /// (one broadcast from K = 4). Same operations in the same order per lane as the scalar
    /// step, so the results are bit-identical.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn step_k<const K: u32>(
        table: &[f32; 65536],
        prev: &[f32],
        next: &mut [f32],
        bp: &mut [u8],
        w: f32,
    ) {
        let kr = 16 - K;
        let edges = 1usize << kr;
        debug_assert!(prev.len() >= edges + 16 && next.len() >= edges && bp.len() >= edges);
        let wv = _mm512_set1_ps(w);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let perm = _mm512_srli_epi32::<K>(lanes);
        let (tp, pp) = (table.as_ptr(), prev.as_ptr());
        const G: usize = 4;
        for o0 in (0..edges).step_by(16 * G) {
            let mut best = [_mm512_set1_ps(f32::INFINITY); G];
            let mut bk = [_mm512_setzero_si512(); G];
            for c in 0..1usize << K {
                let cv = _mm512_set1_epi32(c as i32);
                for g in 0..G {
                    let o = o0 + 16 * g;
                    let v = _mm512_loadu_ps(tp.add((c << kr) | o));
                    let base = (c << (kr - K)) | (o >> K);
                    let p = if K >= 4 {
                        _mm512_set1_ps(*pp.add(base))
                    } else {
                        _mm512_permutexvar_ps(perm, _mm512_loadu_ps(pp.add(base)))
                    };
                    let d = _mm512_sub_ps(v, wv);
                    let cost = _mm512_add_ps(p, _mm512_mul_ps(d, d));
                    let lt = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(cost, best[g]);
                    best[g] = _mm512_mask_mov_ps(best[g], lt, cost);
                    bk[g] = _mm512_mask_mov_epi32(bk[g], lt, cv);
                }
            }
            for g in 0..G {
                let o = o0 + 16 * g;
                _mm512_storeu_ps(next.as_mut_ptr().add(o), best[g]);
                _mm_storeu_si128(
                    bp.as_mut_ptr().add(o) as *mut __m128i,
                    _mm512_cvtepi32_epi8(bk[g]),
                );
            }
        }
    }

    /// Dispatches to the kernel compiled for this K (1..=8).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn step(
        k: u32,
        table: &[f32; 65536],
        prev: &[f32],
        next: &mut [f32],
        bp: &mut [u8],
        w: f32,
    ) {
        match k {
            1 => step_k::<1>(table, prev, next, bp, w),
            2 => step_k::<2>(table, prev, next, bp, w),
            3 => step_k::<3>(table, prev, next, bp, w),
            4 => step_k::<4>(table, prev, next, bp, w),
            5 => step_k::<5>(table, prev, next, bp, w),
            6 => step_k::<6>(table, prev, next, bp, w),
            7 => step_k::<7>(table, prev, next, bp, w),
            _ => step_k::<8>(table, prev, next, bp, w),
        }
    }
}

fn step_with(
    level: Level,
    k: u32,
    table: &[f32; 65536],
    prev: &[f32],
    next: &mut [f32],
    bp: &mut [u8],
    w: f32,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 if level.is_available() => {
            // SAFETY: the level's features were checked at run time; buffers are sized by
            // `Scratch::new` for this K (costs padded by 16).
            unsafe { avx512::step(k, table, prev, next, bp, w) }
        }
        _ => step_scalar(k, table, prev, next, bp, w),
    }
}

/// One forward pass over the positions `(i + roll) & 255`, `i = 0..256`, from `start` (`None`:
/// any edge at cost 0; `Some(e)`: only edge `e`). Leaves the final costs in `s.cost`. Steps
/// before `keep_from` need no back-pointers and skip storing them.
fn forward(
    level: Level,
    s: &mut Scratch,
    table: &[f32; 65536],
    targets: &[f32; 256],
    roll: usize,
    start: Option<usize>,
    keep_from: usize,
) {
    let k = s.k;
    let edges = 1usize << (16 - k);
    match start {
        None => s.cost[..edges].fill(0.0),
        Some(e) => {
            s.cost[..edges].fill(f32::INFINITY);
            s.cost[e] = 0.0;
        }
    }
    for i in 0..256 {
        let w = targets[(i + roll) & 255];
        let bp = if i >= keep_from {
            &mut s.bp[i * edges..(i + 1) * edges]
        } else {
            &mut s.spare[..]
        };
        step_with(level, k, table, &s.cost, &mut s.next, bp, w);
        std::mem::swap(&mut s.cost, &mut s.next);
    }
}

/// Follows the back-pointers from edge `end` after the last step down to step `stop`, writing
/// the states of the positions it passes; returns the edge before step `stop`.
fn backtrack(s: &Scratch, roll: usize, end: usize, stop: usize, states: &mut [u16; 256]) -> usize {
    let (k, kr) = (s.k, 16 - s.k);
    let edges = 1usize << kr;
    let mut edge = end;
    for i in (stop..256).rev() {
        let state = ((s.bp[i * edges + edge] as usize) << kr) | edge;
        states[(i + roll) & 255] = state as u16;
        edge = state >> k;
    }
    edge
}

/// First index of the smallest cost (NaN never wins).
fn argmin(costs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &c) in costs.iter().enumerate() {
        if c < costs[best] || costs[best].is_nan() && !c.is_nan() {
            best = i;
        }
    }
    best
}

/// The states of the best circular stream for `targets` (in position order), and its cost.
/// Non-finite targets give some valid stream (their positions cost infinity), never a panic.
pub fn viterbi_with(
    level: Level,
    s: &mut Scratch,
    cb: Codebook,
    targets: &[f32; 256],
) -> ([u16; 256], f32) {
    let table = codebook::table(cb);
    let edges = 1usize << (16 - s.k);
    let mut states = [0u16; 256];
    // Pass 1, rolled by 128: only its steps over positions 0..127 (i >= 128) are traced back,
    // to the edge between positions 255 and 0.
    forward(level, s, table, targets, 128, None, 128);
    let end = argmin(&s.cost[..edges]);
    let wrap = backtrack(s, 128, end, 128, &mut states);
    // Pass 2: from that edge back to it.
    forward(level, s, table, targets, 0, Some(wrap), 0);
    let cost = s.cost[wrap];
    backtrack(s, 0, wrap, 0, &mut states);
    (states, cost)
}

/// The stream bits of a state sequence: position `p` owns bits `[p K, p K + K)`, the low K bits
/// of its state, most significant first, in little-endian u32 words (the reader's view).
pub fn pack(states: &[u16; 256], k: u32) -> Vec<u8> {
    let mut words = vec![0u32; 8 * k as usize];
    for (p, &st) in states.iter().enumerate() {
        let sym = st as u32 & ((1 << k) - 1);
        for b in 0..k {
            let bit = p as u32 * k + b;
            if sym >> (k - 1 - b) & 1 == 1 {
                words[bit as usize / 32] |= 1 << (31 - bit % 32);
            }
        }
    }
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Encodes one tile given row-major (`[in 16][out 16]`), with the best kernel this machine has.
pub fn encode_tile(tile: &[f32; 256], k: u32, cb: Codebook, s: &mut Scratch) -> EncodedTile {
    encode_tile_with(super::simd::best_level(), tile, k, cb, s)
}

/// [`encode_tile`] at a given kernel level (scalar and AVX-512 give identical tiles).
pub fn encode_tile_with(
    level: Level,
    tile: &[f32; 256],
    k: u32,
    cb: Codebook,
    s: &mut Scratch,
) -> EncodedTile {
    assert_eq!(s.k, k, "scratch made for another K");
    let mut targets = [0.0f32; 256];
    for (t, &i) in targets.iter_mut().zip(POSITION_INDEX.iter()) {
        *t = tile[i as usize];
    }
    let (states, cost) = viterbi_with(level, s, cb, &targets);
    let table = codebook::table(cb);
    let mut values = [0.0f32; 256];
    for (&st, &i) in states.iter().zip(POSITION_INDEX.iter()) {
        values[i as usize] = table[st as usize];
    }
    EncodedTile {
        bytes: pack(&states, k),
        values,
        cost,
    }
}

/// Encodes many tiles on the caller's rayon pool (one scratch per worker).
pub fn encode_tiles(tiles: &[[f32; 256]], k: u32, cb: Codebook) -> Vec<EncodedTile> {
    tiles
        .par_iter()
        .map_init(|| Scratch::new(k), |s, t| encode_tile(t, k, cb, s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_inverts_state() {
        // Random consistent state sequences: each state's high bits are the previous state's
        // low bits, circularly; the reader must read back every state.
        let mut seed = 0x1234_5678u64;
        for k in 1..=8u32 {
            let mut syms = [0u32; 256];
            for v in syms.iter_mut() {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *v = (seed >> 40) as u32 & ((1 << k) - 1);
            }
            let state_at = |p: usize| -> u16 {
                let mut s = 0u32;
                for j in (0..16usize.div_ceil(k as usize) + 1).rev() {
                    s = (s << k) | syms[(p + 256 * 4 - j) % 256];
                }
                s as u16
            };
            let states: [u16; 256] = std::array::from_fn(state_at);
            let bytes = pack(&states, k);
            let rate = super::super::Bitrate::int(k);
            for (p, &st) in states.iter().enumerate() {
                assert_eq!(super::super::trellis::state(&bytes, rate, p as u32), st);
            }
        }
    }
}
