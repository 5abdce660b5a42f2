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
//! passes make the result a valid circular stream: the first runs unconstrained over a window
//! around the wrap ([`PASS1`]: the last 64 positions, then the first 64), and the edge its best
//! path crosses between positions 255 and 0 becomes the forced start and end of the second,
//! which is the exact optimum among streams with that edge (up to the tie rule of the tagged
//! costs, [`tag_mask`]). Survivor paths merge within a few multiples of the trellis's memory
//! (16 / K positions), so the window finds the edge a whole unconstrained pass finds but for
//! near-ties: on Gaussian tiles the mean squared error is 0.5% / 0.3% / 0.1% / 0.0% above a
//! whole rolled pass's at K = 2 / 3 / 4 / 6, for 3/4 of the steps. The reported cost is the
//! decoded tile's squared error summed in position order.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::codebook::{self, Codebook};
use super::simd::Level;
use super::trellis::POSITION_INDEX;

/// Pass 1 of [`viterbi_with`]: `steps` steps over the positions `(first + i) & 255` from a free
/// start, its steps from `traced` on traced back to the edge between positions 255 and 0.
#[derive(Debug, Clone, Copy)]
pub struct Pass1 {
    pub first: usize,
    pub steps: usize,
    pub traced: usize,
}

/// The last 64 positions, then the first 64, traced back over the latter.
pub const PASS1: Pass1 = Pass1 {
    first: 256 - 64,
    steps: 128,
    traced: 64,
};

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
    cost: Lines,
    next: Lines,
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
            cost: Lines::zeros(edges + 16),
            next: Lines::zeros(edges + 16),
            spare: vec![0; edges],
        }
    }

    /// Costs before a pass: every edge free (`None`), or only `start`.
    fn start_costs(&mut self, start: Option<usize>) {
        let edges = 1usize << (16 - self.k);
        match start {
            None => self.cost[..edges].fill(0.0),
            Some(e) => {
                self.cost[..edges].fill(f32::INFINITY);
                self.cost[e] = 0.0;
            }
        }
    }
}

/// f32s on 64-byte cache lines, so the step's vector loads and stores of 16 never straddle two
/// lines (at the 16-byte offset the allocator gave them, the search ran 15-25% slower).
struct Lines(Vec<Line>);

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; 16]);

impl Lines {
    /// At least `n` zeros.
    fn zeros(n: usize) -> Lines {
        Lines(vec![Line([0.0; 16]); n.div_ceil(16)])
    }
}

impl std::ops::Deref for Lines {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: a Line is 16 f32s and nothing else (64 bytes, no padding).
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), 16 * self.0.len()) }
    }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for Deref, through the unique borrow.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast(), 16 * self.0.len()) }
    }
}

/// Edges per block of [`search_table`]: what one pass of the AVX-512 step's outer loop covers
/// (four chains of 16 lanes).
const BLOCK: usize = 64;

/// The edge (within its group of 16) that lane `j` of the AVX-512 step holds. From K = 4 on,
/// lane `j` is edge `j`. Below, the 16 edges' previous costs are only `m = 16 >> K` values,
/// and with lane `j` on edge `(j % m) 2^K + j / m` they lie in the lanes as one `m`-value
/// pattern repeated: a broadcast load instead of a permute per candidate. The step puts its
/// results back in edge order once per 16 edges.
fn lane_edge(k: u32, j: usize) -> usize {
    if k >= 4 {
        j
    } else {
        let m = 16 >> k;
        (j % m) * (1 << k) + j / m
    }
}

/// Edges per block of the AVX2 step's table: its four chains of 8 lanes.
const BLOCK_AVX2: usize = 32;

/// The codebook's values in the order a SIMD step reads them for `K`: per block of `block`
/// edges ([`BLOCK`] for AVX-512, [`BLOCK_AVX2`] for AVX2), candidate `c`'s values for those
/// edges, `c` after `c` (AVX-512's lanes as [`lane_edge`] orders them, AVX2's in edge order). In
/// the plain table the 2^K candidates of an edge lie 2^(16-K) values apart, so their streams
/// alias in the L1 cache; here a step reads the table front to back.
fn search_table(cb: Codebook, k: u32, block: usize) -> &'static [f32] {
    static TABLES: [[[OnceLock<Box<codebook::Table>>; 8]; 3]; 2] =
        [const { [const { [const { OnceLock::new() }; 8] }; 3] }; 2];
    let i = Codebook::ALL.iter().position(|(c, _)| *c == cb).unwrap();
    &TABLES[usize::from(block == BLOCK_AVX2)][i][k as usize - 1]
        .get_or_init(|| {
            let (table, kr) = (codebook::table(cb), 16 - k);
            let mut t = Box::new(codebook::Table([0.0; 65536]));
            for (i, v) in t.0.iter_mut().enumerate() {
                let (b, c, j) = (i / (block << k), i / block % (1 << k), i % block);
                let lane = if block == BLOCK {
                    j / 16 * 16 + lane_edge(k, j % 16)
                } else {
                    j
                };
                *v = table[(c << kr) | (b * block + lane)];
            }
            t
        })
        .0
}

/// The low K bits of a candidate's f32 cost carry its `c`, so one unsigned minimum of the bit
/// patterns (costs are never negative, so their bits order as their values) gives the best
/// cost and its back-pointer together; the lowest `c` wins ties. Costs that differ only in those
/// K bits (2^(K-23) relative) count as equal.
fn tag_mask(k: u32) -> u32 {
    (1 << k) - 1
}

/// Runs `f` with this thread's scratch for K, made once and kept (it is megabytes at small K:
/// allocating it per call costs more in page clearing than a tile's search).
fn with_scratch<R>(k: u32, f: impl FnOnce(&mut Scratch) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
    }
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|s| s.k != k) {
            *slot = Some(Scratch::new(k));
        }
        f(slot.as_mut().unwrap())
    })
}

/// One trellis step: for every edge `o`, the best of the 2^K states `(c << (16-K)) | o`, each
/// costing `fma(d, d, prev[state >> K])`, `d = value(state) - w`, tagged with `c`. Writes `next`
/// (untagged) and the back-pointers `bp` (one byte per edge).
fn step_scalar(
    k: u32,
    table: &[f32; 65536],
    prev: &[f32],
    next: &mut [f32],
    bp: &mut [u8],
    w: f32,
) {
    let kr = 16 - k;
    let tag = tag_mask(k);
    for o in 0..1usize << kr {
        let mut best = u32::MAX;
        for c in 0..1usize << k {
            let s = (c << kr) | o;
            let d = table[s] - w;
            let cost = d.mul_add(d, prev[s >> k]);
            best = best.min(cost.to_bits() & !tag | c as u32);
        }
        next[o] = f32::from_bits(best & !tag);
        bp[o] = (best & tag) as u8;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::step_scalar`] on a block of 64 edges at a time (four independent 16-lane
    /// chains), the values read from [`super::search_table`] and, below K = 4, the lanes in
    /// [`super::lane_edge`]'s order. Per 16 states: a subtract, an fma, a ternary-logic tag and
    /// an unsigned minimum; the same operations per lane as the scalar step, so the results
    /// are bit-identical.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    unsafe fn step_k<const K: u32>(
        table: &[f32],
        prev: &[f32],
        next: &mut [f32],
        bp: &mut [u8],
        w: f32,
    ) {
        let kr = 16 - K;
        let edges = 1usize << kr;
        debug_assert!(prev.len() >= edges + 16 && next.len() >= edges && bp.len() >= edges);
        let wv = _mm512_set1_ps(w);
        let tag = _mm512_set1_epi32(super::tag_mask(K) as i32);
        let keep = _mm512_set1_epi32(!super::tag_mask(K) as i32);
        // Lane j of a result holds edge lane_edge(j): back to edge order.
        let mut inverse = [0i32; 16];
        for j in 0..16 {
            inverse[super::lane_edge(K, j)] = j as i32;
        }
        let unshuffle = _mm512_loadu_si512(inverse.as_ptr() as *const _);
        let (tp, pp) = (table.as_ptr(), prev.as_ptr());
        const G: usize = super::BLOCK / 16;
        for o0 in (0..edges).step_by(super::BLOCK) {
            let mut best = [_mm512_set1_epi32(-1); G];
            let block = tp.add(o0 << K);
            for c in 0..1usize << K {
                let cv = _mm512_set1_epi32(c as i32);
                for (g, best) in best.iter_mut().enumerate() {
                    let o = o0 + 16 * g;
                    let v = _mm512_loadu_ps(block.add(c * super::BLOCK + 16 * g));
                    let base = pp.add((c << (kr - K)) | (o >> K));
                    let p = match K {
                        // m = 8, 4, 2 costs, repeated 2^K times.
                        1 => _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                            base as *const f64,
                        ))),
                        2 => _mm512_broadcast_f32x4(_mm_loadu_ps(base)),
                        3 => {
                            _mm512_castpd_ps(_mm512_set1_pd((base as *const f64).read_unaligned()))
                        }
                        _ => _mm512_set1_ps(*base),
                    };
                    let d = _mm512_sub_ps(v, wv);
                    let cost = _mm512_castps_si512(_mm512_fmadd_ps(d, d, p));
                    // (cost & keep) | c
                    let tagged = _mm512_ternarylogic_epi32::<0xEA>(cost, keep, cv);
                    *best = _mm512_min_epu32(*best, tagged);
                }
            }
            for (g, &best) in best.iter().enumerate() {
                let o = o0 + 16 * g;
                let best = if K >= 4 {
                    best
                } else {
                    _mm512_permutexvar_epi32(unshuffle, best)
                };
                _mm512_storeu_si512(
                    next.as_mut_ptr().add(o) as *mut _,
                    _mm512_and_si512(best, keep),
                );
                _mm_storeu_si128(
                    bp.as_mut_ptr().add(o) as *mut __m128i,
                    _mm512_cvtepi32_epi8(_mm512_and_si512(best, tag)),
                );
            }
        }
    }

    /// [`step_k`] for [`super::GROUP`] tiles at once: each codebook vector loaded serves every
    /// tile (the table is 256 KB, read from L2 once a step instead of once a tile a step). Per
    /// lane the same operations as [`step_k`], so each tile's results are bit-identical.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    #[allow(clippy::needless_range_loop)] // g and t index the table, tiles and minima together
    unsafe fn step_group_k<const K: u32>(
        table: &[f32],
        prev: [*const f32; super::GROUP],
        next: [*mut f32; super::GROUP],
        bp: [*mut u8; super::GROUP],
        w: [f32; super::GROUP],
    ) {
        const T: usize = super::GROUP;
        let kr = 16 - K;
        let edges = 1usize << kr;
        let wv: [__m512; T] = std::array::from_fn(|t| _mm512_set1_ps(w[t]));
        let tag = _mm512_set1_epi32(super::tag_mask(K) as i32);
        let keep = _mm512_set1_epi32(!super::tag_mask(K) as i32);
        let mut inverse = [0i32; 16];
        for j in 0..16 {
            inverse[super::lane_edge(K, j)] = j as i32;
        }
        let unshuffle = _mm512_loadu_si512(inverse.as_ptr() as *const _);
        let tp = table.as_ptr();
        const G: usize = super::BLOCK / 16;
        for o0 in (0..edges).step_by(super::BLOCK) {
            let mut best = [[_mm512_set1_epi32(-1); G]; T];
            let block = tp.add(o0 << K);
            for c in 0..1usize << K {
                let cv = _mm512_set1_epi32(c as i32);
                for g in 0..G {
                    let o = o0 + 16 * g;
                    let v = _mm512_loadu_ps(block.add(c * super::BLOCK + 16 * g));
                    let at = (c << (kr - K)) | (o >> K);
                    for t in 0..T {
                        let base = prev[t].add(at);
                        let p = match K {
                            1 => _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                                base as *const f64,
                            ))),
                            2 => _mm512_broadcast_f32x4(_mm_loadu_ps(base)),
                            3 => _mm512_castpd_ps(_mm512_set1_pd(
                                (base as *const f64).read_unaligned(),
                            )),
                            _ => _mm512_set1_ps(*base),
                        };
                        let d = _mm512_sub_ps(v, wv[t]);
                        let cost = _mm512_castps_si512(_mm512_fmadd_ps(d, d, p));
                        let tagged = _mm512_ternarylogic_epi32::<0xEA>(cost, keep, cv);
                        best[t][g] = _mm512_min_epu32(best[t][g], tagged);
                    }
                }
            }
            for t in 0..T {
                for (g, &best) in best[t].iter().enumerate() {
                    let o = o0 + 16 * g;
                    let best = if K >= 4 {
                        best
                    } else {
                        _mm512_permutexvar_epi32(unshuffle, best)
                    };
                    _mm512_storeu_si512(next[t].add(o) as *mut _, _mm512_and_si512(best, keep));
                    _mm_storeu_si128(
                        bp[t].add(o) as *mut __m128i,
                        _mm512_cvtepi32_epi8(_mm512_and_si512(best, tag)),
                    );
                }
            }
        }
    }

    /// Dispatches [`step_group_k`] for this K (1..=8).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn step_group(
        k: u32,
        table: &[f32],
        prev: [*const f32; super::GROUP],
        next: [*mut f32; super::GROUP],
        bp: [*mut u8; super::GROUP],
        w: [f32; super::GROUP],
    ) {
        match k {
            1 => step_group_k::<1>(table, prev, next, bp, w),
            2 => step_group_k::<2>(table, prev, next, bp, w),
            3 => step_group_k::<3>(table, prev, next, bp, w),
            4 => step_group_k::<4>(table, prev, next, bp, w),
            5 => step_group_k::<5>(table, prev, next, bp, w),
            6 => step_group_k::<6>(table, prev, next, bp, w),
            7 => step_group_k::<7>(table, prev, next, bp, w),
            _ => step_group_k::<8>(table, prev, next, bp, w),
        }
    }

    /// Dispatches to the kernel compiled for this K (1..=8).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn step(
        k: u32,
        table: &[f32],
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::step_scalar`] on 32 edges at a time (four 8-lane chains), the values read from
    /// [`super::search_table`], as the AVX-512 step with an and + or for the tag;
    /// bit-identical to the scalar step.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn step_k<const K: u32>(
        table: &[f32],
        prev: &[f32],
        next: &mut [f32],
        bp: &mut [u8],
        w: f32,
    ) {
        let kr = 16 - K;
        let edges = 1usize << kr;
        debug_assert!(prev.len() >= edges + 16 && next.len() >= edges && bp.len() >= edges);
        let wv = _mm256_set1_ps(w);
        let tag = _mm256_set1_epi32(super::tag_mask(K) as i32);
        let keep = _mm256_set1_epi32(!super::tag_mask(K) as i32);
        let perm = _mm256_srlv_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(K as i32),
        );
        let (tp, pp) = (table.as_ptr(), prev.as_ptr());
        // Byte 0 of each dword to the low four bytes of its 128-bit half (back-pointers).
        let low_bytes = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1,
            -1, -1, -1, -1, -1, -1, -1, -1, -1,
        );
        const G: usize = super::BLOCK_AVX2 / 8;
        for o0 in (0..edges).step_by(super::BLOCK_AVX2) {
            let mut best = [_mm256_set1_epi32(-1); G];
            let block = tp.add(o0 << K);
            for c in 0..1usize << K {
                let cv = _mm256_set1_epi32(c as i32);
                for (g, best) in best.iter_mut().enumerate() {
                    let o = o0 + 8 * g;
                    let v = _mm256_loadu_ps(block.add(c * super::BLOCK_AVX2 + 8 * g));
                    let base = (c << (kr - K)) | (o >> K);
                    let p = if K >= 3 {
                        _mm256_set1_ps(*pp.add(base))
                    } else {
                        _mm256_permutevar8x32_ps(_mm256_loadu_ps(pp.add(base)), perm)
                    };
                    let d = _mm256_sub_ps(v, wv);
                    let cost = _mm256_castps_si256(_mm256_fmadd_ps(d, d, p));
                    let tagged = _mm256_or_si256(_mm256_and_si256(cost, keep), cv);
                    *best = _mm256_min_epu32(*best, tagged);
                }
            }
            for (g, &best) in best.iter().enumerate() {
                let o = o0 + 8 * g;
                _mm256_storeu_si256(
                    next.as_mut_ptr().add(o) as *mut __m256i,
                    _mm256_and_si256(best, keep),
                );
                let b = _mm256_shuffle_epi8(_mm256_and_si256(best, tag), low_bytes);
                let b =
                    _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
                _mm_storel_epi64(bp.as_mut_ptr().add(o) as *mut __m128i, b);
            }
        }
    }

    /// Dispatches to the kernel compiled for this K (1..=8).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn step(
        k: u32,
        table: &[f32],
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

#[allow(clippy::too_many_arguments)]
fn step_with(
    level: Level,
    cb: Codebook,
    k: u32,
    prev: &[f32],
    next: &mut [f32],
    bp: &mut [u8],
    w: f32,
) {
    match level {
        // SAFETY (both): the level's features were checked at run time; buffers are sized by
        // `Scratch::new` for this K (costs padded by 16), the search table for this K.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 if level.is_available() => unsafe {
            avx512::step(k, search_table(cb, k, BLOCK), prev, next, bp, w)
        },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 if level.is_available() => unsafe {
            avx2::step(k, search_table(cb, k, BLOCK_AVX2), prev, next, bp, w)
        },
        _ => step_scalar(k, codebook::table(cb), prev, next, bp, w),
    }
}

/// `steps` forward steps over the positions `(first + i) & 255` from `start` (`None`: any edge
/// at cost 0; `Some(e)`: only edge `e`). Leaves the final costs in `s.cost`. Steps before
/// `keep_from` need no back-pointers and skip storing them.
#[allow(clippy::too_many_arguments)]
fn forward(
    level: Level,
    s: &mut Scratch,
    cb: Codebook,
    targets: &[f32; 256],
    first: usize,
    steps: usize,
    start: Option<usize>,
    keep_from: usize,
) {
    let k = s.k;
    let edges = 1usize << (16 - k);
    s.start_costs(start);
    for i in 0..steps {
        let w = targets[(first + i) & 255];
        let bp = if i >= keep_from {
            &mut s.bp[i * edges..(i + 1) * edges]
        } else {
            &mut s.spare[..]
        };
        step_with(level, cb, k, &s.cost, &mut s.next, bp, w);
        std::mem::swap(&mut s.cost, &mut s.next);
    }
}

/// Follows the back-pointers from edge `end` after step `steps - 1` down to step `stop`,
/// writing the states of the positions `(first + i) & 255` it passes; returns the edge before
/// step `stop`.
fn backtrack(
    s: &Scratch,
    first: usize,
    steps: usize,
    end: usize,
    stop: usize,
    states: &mut [u16; 256],
) -> usize {
    let (k, kr) = (s.k, 16 - s.k);
    let edges = 1usize << kr;
    let mut edge = end;
    for i in (stop..steps).rev() {
        let state = ((s.bp[i * edges + edge] as usize) << kr) | edge;
        states[(first + i) & 255] = state as u16;
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

/// The states of the best circular stream for `targets` (in position order), and its squared
/// error summed in position order (separate multiplies and adds, as a plain loop over the
/// decoded tile sums it). Non-finite targets give some valid stream (their positions cost
/// infinity), never a panic.
pub fn viterbi_with(
    level: Level,
    s: &mut Scratch,
    cb: Codebook,
    targets: &[f32; 256],
) -> ([u16; 256], f32) {
    let edges = 1usize << (16 - s.k);
    let mut states = [0u16; 256];
    let p = PASS1;
    forward(level, s, cb, targets, p.first, p.steps, None, p.traced);
    let end = argmin(&s.cost[..edges]);
    let wrap = backtrack(s, p.first, p.steps, end, p.traced, &mut states);
    // Pass 2: the whole tile from that edge back to it.
    forward(level, s, cb, targets, 0, 256, Some(wrap), 0);
    backtrack(s, 0, 256, wrap, 0, &mut states);
    (states, stream_cost(&states, targets, cb))
}

/// Tiles the AVX-512 search runs together (see `avx512::step_group_k`).
const GROUP: usize = 4;

/// [`forward`] for [`GROUP`] tiles in step, on AVX-512.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn forward_group(
    ss: &mut [Scratch; GROUP],
    cb: Codebook,
    targets: [&[f32; 256]; GROUP],
    first: usize,
    steps: usize,
    start: [Option<usize>; GROUP],
    keep_from: usize,
) {
    let k = ss[0].k;
    let edges = 1usize << (16 - k);
    for (s, start) in ss.iter_mut().zip(start) {
        s.start_costs(start);
    }
    let table = search_table(cb, k, BLOCK);
    for i in 0..steps {
        let w = std::array::from_fn(|t| targets[t][(first + i) & 255]);
        let prev = std::array::from_fn(|t| ss[t].cost.as_ptr());
        let next = std::array::from_fn(|t| ss[t].next.as_mut_ptr());
        let bp = std::array::from_fn(|t| {
            let s = &mut ss[t];
            if i >= keep_from {
                s.bp[i * edges..(i + 1) * edges].as_mut_ptr()
            } else {
                s.spare.as_mut_ptr()
            }
        });
        // SAFETY: AVX-512 was checked by the caller; each tile's buffers are its own scratch's,
        // sized by `Scratch::new` for this K (costs padded by 16), the table for this K.
        unsafe { avx512::step_group(k, table, prev, next, bp, w) };
        for s in ss.iter_mut() {
            std::mem::swap(&mut s.cost, &mut s.next);
        }
    }
}

/// [`viterbi_with`] at [`Level::Avx512`] for [`GROUP`] tiles at once: the same states and costs.
#[cfg(target_arch = "x86_64")]
fn viterbi_group(
    ss: &mut [Scratch; GROUP],
    cb: Codebook,
    targets: [&[f32; 256]; GROUP],
) -> [([u16; 256], f32); GROUP] {
    let edges = 1usize << (16 - ss[0].k);
    let mut states = [[0u16; 256]; GROUP];
    let p = PASS1;
    forward_group(ss, cb, targets, p.first, p.steps, [None; GROUP], p.traced);
    let wrap: [usize; GROUP] = std::array::from_fn(|t| {
        let end = argmin(&ss[t].cost[..edges]);
        backtrack(&ss[t], p.first, p.steps, end, p.traced, &mut states[t])
    });
    forward_group(ss, cb, targets, 0, 256, wrap.map(Some), 0);
    std::array::from_fn(|t| {
        backtrack(&ss[t], 0, 256, wrap[t], 0, &mut states[t]);
        (states[t], stream_cost(&states[t], targets[t], cb))
    })
}

/// [`open_cost_with`] at [`Level::Avx512`] for [`GROUP`] tiles at once.
#[cfg(target_arch = "x86_64")]
fn open_cost_group(
    ss: &mut [Scratch; GROUP],
    cb: Codebook,
    targets: [&[f32; 256]; GROUP],
) -> [f32; GROUP] {
    let edges = 1usize << (16 - ss[0].k);
    forward_group(ss, cb, targets, 0, 256, [None; GROUP], 256);
    std::array::from_fn(|t| ss[t].cost[argmin(&ss[t].cost[..edges])])
}

/// Runs `f` with this thread's [`GROUP`] scratches for K, made once and kept.
fn with_group_scratch<R>(k: u32, f: impl FnOnce(&mut [Scratch; GROUP]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Option<Box<[Scratch; GROUP]>>> = const { std::cell::RefCell::new(None) };
    }
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|s| s[0].k != k) {
            *slot = Some(Box::new(std::array::from_fn(|_| Scratch::new(k))));
        }
        f(slot.as_mut().unwrap())
    })
}

/// A row-major tile (`[in 16][out 16]`) in trellis position order, as the search takes it.
pub fn position_order(tile: &[f32; 256]) -> [f32; 256] {
    std::array::from_fn(|p| tile[POSITION_INDEX[p] as usize])
}

/// The squared error of the values `states` decode to against `targets` (position order),
/// summed in position order with separate multiplies and adds.
pub fn stream_cost(states: &[u16; 256], targets: &[f32; 256], cb: Codebook) -> f32 {
    let table = codebook::table(cb);
    states.iter().zip(targets).fold(0.0f32, |acc, (&st, &t)| {
        let d = table[st as usize] - t;
        acc + d * d
    })
}

impl EncodedTile {
    /// The tile a search's states encode at K bits, with the search's cost.
    pub fn from_states(states: &[u16; 256], cost: f32, k: u32, cb: Codebook) -> EncodedTile {
        let table = codebook::table(cb);
        let mut values = [0.0f32; 256];
        for (&st, &i) in states.iter().zip(POSITION_INDEX.iter()) {
            values[i as usize] = table[st as usize];
        }
        EncodedTile {
            bytes: pack(states, k),
            values,
            cost,
        }
    }
}

/// The squared error of the best stream for `targets` when its ends need not meet (one
/// unconstrained pass, no back-pointers): half the work of [`viterbi_with`], and within the
/// wrap-around's few positions of its cost, which is all a comparison of scales needs.
pub fn open_cost_with(level: Level, s: &mut Scratch, cb: Codebook, targets: &[f32; 256]) -> f32 {
    let edges = 1usize << (16 - s.k);
    forward(level, s, cb, targets, 0, 256, None, 256);
    s.cost[argmin(&s.cost[..edges])]
}

/// [`open_cost_with`] of many tiles (row-major, as [`encode_tile`] takes them) on the caller's
/// rayon pool.
pub fn open_costs(tiles: &[[f32; 256]], k: u32, cb: Codebook) -> Vec<f32> {
    let level = super::simd::best_level();
    tiles
        .par_chunks(GROUP)
        .flat_map_iter(|chunk| {
            let targets: Vec<[f32; 256]> = chunk.iter().map(position_order).collect();
            #[cfg(target_arch = "x86_64")]
            if level == Level::Avx512 && chunk.len() == GROUP {
                let t = std::array::from_fn(|i| &targets[i]);
                return with_group_scratch(k, |ss| open_cost_group(ss, cb, t)).to_vec();
            }
            targets
                .iter()
                .map(|t| with_scratch(k, |s| open_cost_with(level, s, cb, t)))
                .collect()
        })
        .collect()
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
    let (states, cost) = viterbi_with(level, s, cb, &position_order(tile));
    EncodedTile::from_states(&states, cost, k, cb)
}

/// Encodes many tiles on the caller's rayon pool (one scratch per worker thread, kept).
pub fn encode_tiles(tiles: &[[f32; 256]], k: u32, cb: Codebook) -> Vec<EncodedTile> {
    let level = super::simd::best_level();
    tiles
        .par_chunks(GROUP)
        .flat_map_iter(|chunk| {
            #[cfg(target_arch = "x86_64")]
            if level == Level::Avx512 && chunk.len() == GROUP {
                let targets: Vec<[f32; 256]> = chunk.iter().map(position_order).collect();
                let t = std::array::from_fn(|i| &targets[i]);
                let found = with_group_scratch(k, |ss| viterbi_group(ss, cb, t));
                return found
                    .iter()
                    .map(|(states, cost)| EncodedTile::from_states(states, *cost, k, cb))
                    .collect::<Vec<_>>();
            }
            chunk
                .iter()
                .map(|t| with_scratch(k, |s| encode_tile_with(level, t, k, cb, s)))
                .collect()
        })
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
