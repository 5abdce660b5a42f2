//! Single-threaded throughput of the fused dequantize + dot kernels, per type, level and number of
//! activation rows, next to a baseline (exact `dequantize_row` into a buffer, then an 8-lane dot)
//! and the machine's single-core read bandwidth.
//!
//! `cargo run --release -p trellm-quant --example dot_bench [-- FILTER...]`: a FILTER keeps the
//! cases whose label contains it (e.g. `Q4_K`, `lm_head`); `--n=1,4` picks activation counts.

use std::time::Instant;

use half::f16;
use trellm_quant::ggml::dot::{available_levels, dot_block_with};
use trellm_quant::ggml::{dequantize_row, GgmlType};

struct Case {
    label: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            label: "Q4_0 640x2048".into(),
            ty: GgmlType::Q4_0,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q4_1 576x1536".into(),
            ty: GgmlType::Q4_1,
            rows: 576,
            cols: 1536,
        },
        Case {
            label: "Q5_0 640x2048".into(),
            ty: GgmlType::Q5_0,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q8_0 640x2048".into(),
            ty: GgmlType::Q8_0,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q4_K 640x2048".into(),
            ty: GgmlType::Q4K,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q6_K 640x2048".into(),
            ty: GgmlType::Q6K,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q5_1 640x2048".into(),
            ty: GgmlType::Q5_1,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q2_K 640x2048".into(),
            ty: GgmlType::Q2K,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q3_K 640x2048".into(),
            ty: GgmlType::Q3K,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q5_K 640x2048".into(),
            ty: GgmlType::Q5K,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "Q8_K 640x2048".into(),
            ty: GgmlType::Q8K,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ4_NL 640x2048".into(),
            ty: GgmlType::IQ4NL,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ4_XS 640x2048".into(),
            ty: GgmlType::IQ4XS,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ3_S 640x2048".into(),
            ty: GgmlType::IQ3S,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ3_XXS 640x2048".into(),
            ty: GgmlType::IQ3XXS,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ2_S 640x2048".into(),
            ty: GgmlType::IQ2S,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ2_XS 640x2048".into(),
            ty: GgmlType::IQ2XS,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "IQ2_XXS 640x2048".into(),
            ty: GgmlType::IQ2XXS,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "F16 640x2048".into(),
            ty: GgmlType::F16,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "BF16 640x2048".into(),
            ty: GgmlType::BF16,
            rows: 640,
            cols: 2048,
        },
        Case {
            label: "F32 576x1536".into(),
            ty: GgmlType::F32,
            rows: 576,
            cols: 1536,
        },
        Case {
            label: "Q8_0 lm_head 262144x640".into(),
            ty: GgmlType::Q8_0,
            rows: 262_144,
            cols: 640,
        },
    ]
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random bytes with model-like, finite scales.
fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    use GgmlType::*;
    let bb = ty.block_bytes();
    let mut w = vec![0u8; ty.bytes_for(cols).unwrap() * rows];
    for b in w.chunks_exact_mut(8) {
        b.copy_from_slice(&rng.next().to_le_bytes());
    }
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes())
    };
    for b in w.chunks_exact_mut(bb) {
        let s = 0.01 + 0.01 * rng.unit();
        match ty {
            F32 => b.copy_from_slice(&(rng.unit() * 0.1).to_le_bytes()),
            F16 | BF16 => put(b, 0, rng.unit() * 0.1),
            Q4_0 | Q5_0 | Q8_0 | IQ4NL => put(b, 0, s),
            IQ2XXS | IQ2XS | IQ2S | IQ3XXS | IQ3S | IQ4XS => put(b, 0, s * 0.1),
            Q4_1 => {
                put(b, 0, s);
                put(b, 2, -8.0 * s);
            }
            Q5_1 => {
                put(b, 0, s);
                put(b, 2, -16.0 * s);
            }
            Q2K => {
                put(b, 80, s * 0.1);
                put(b, 82, s * 0.1);
            }
            Q3K => put(b, 108, s * 0.1),
            Q8K => b[..4].copy_from_slice(&(s * 0.01).to_le_bytes()),
            Q4K | Q5K => {
                put(b, 0, s * 0.1);
                put(b, 2, s * 0.1);
            }
            Q6K => put(b, 208, s * 0.1),
            _ => unreachable!(),
        }
    }
    if ty == BF16 {
        // Keep bf16 values finite: clear the top exponent bit of every value.
        for v in w.chunks_exact_mut(2) {
            v[1] &= 0xBF;
        }
    }
    w
}

/// Seconds per call of each of `fs`, measured in interleaved rounds (so a burst of other work on
/// the machine hits all of them alike): the fastest of `ROUNDS` samples of at least ~5 ms each.
/// The best case is the most repeatable measure on a machine shared with other work.
fn race(fs: &mut [Box<dyn FnMut() + '_>]) -> Vec<f64> {
    const ROUNDS: usize = 15;
    let reps: Vec<usize> = fs
        .iter_mut()
        .map(|f| {
            f();
            let t = Instant::now();
            f();
            let once = t.elapsed().as_secs_f64().max(1e-7);
            ((0.005 / once) as usize).max(1)
        })
        .collect();
    let mut best = vec![f64::INFINITY; fs.len()];
    for _ in 0..ROUNDS {
        for ((f, &reps), best) in fs.iter_mut().zip(&reps).zip(&mut best) {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            *best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
    }
    best
}

/// 8-lane dot, the baseline's inner loop (the compiler vectorizes it).
fn dot8(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (a, b) in w.chunks_exact(8).zip(x.chunks_exact(8)) {
        for ((s, a), b) in acc.iter_mut().zip(a).zip(b) {
            *s += a * b;
        }
    }
    acc.iter().sum()
}

fn baseline(ty: GgmlType, w: &[u8], m: usize, x: &[f32], n: usize, out: &mut [f32]) {
    let rb = w.len() / m;
    let cols = x.len() / n;
    let mut buf = vec![0f32; cols];
    for (row, out) in w.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
        dequantize_row(ty, row, &mut buf).unwrap();
        for (t, o) in out.iter_mut().enumerate() {
            *o = dot8(&buf, &x[t * cols..(t + 1) * cols]);
        }
    }
}

/// One pass over `bytes` as eight independent sums of u64 words: a single-core read-bandwidth
/// probe.
fn read_all(bytes: &[u8]) {
    let mut acc = [0u64; 8];
    for c in bytes.chunks_exact(64) {
        for (a, w) in acc.iter_mut().zip(c.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
        }
    }
    std::hint::black_box(acc);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ns: Vec<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("--n="))
        .map(|s| s.split(',').map(|v| v.parse().unwrap()).collect())
        .unwrap_or_else(|| vec![1, 2, 4, 8]);
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    // --case=TYPE:ROWSxCOLS adds a custom shape.
    let mut cases = cases();
    for spec in args.iter().filter_map(|a| a.strip_prefix("--case=")) {
        let (ty, shape) = spec.split_once(':').expect("--case=TYPE:ROWSxCOLS");
        let (r, c) = shape.split_once('x').expect("--case=TYPE:ROWSxCOLS");
        let ty = GgmlType::ALL
            .into_iter()
            .find(|t| t.name() == ty)
            .expect("known type");
        cases.push(Case {
            label: format!("{ty} {shape} custom", ty = ty.name()),
            ty,
            rows: r.parse().unwrap(),
            cols: c.parse().unwrap(),
        });
    }
    let levels = available_levels();
    let mut rng = Rng(1);
    println!(
        "{:<24} {:>8} {:>2} {:>10} {:>9} {:>9} {:>9}",
        "case", "path", "n", "us/call", "Gw/s", "GMAC/s", "x base"
    );
    for case in &cases {
        if !filters.is_empty() && !filters.iter().any(|f| case.label.contains(f.as_str())) {
            continue;
        }
        let (m, cols) = (case.rows, case.cols);
        let w = weights(case.ty, m, cols, &mut rng);
        let nmax = ns.iter().copied().max().unwrap_or(1);
        let x: Vec<f32> = (0..nmax * cols).map(|_| rng.unit()).collect();
        // Matrices far bigger than the caches also time a plain read of the same bytes.
        let streaming = w.len() > 64 << 20;
        let per = w.len() as f64 / (m * cols) as f64;
        for &n in &ns {
            let x = &x[..n * cols];
            // Each contender writes its own output.
            let w = &w;
            let mut fs: Vec<Box<dyn FnMut() + '_>> = Vec::new();
            let mut o = vec![0f32; m * n];
            fs.push(Box::new(move || baseline(case.ty, w, m, x, n, &mut o)));
            for &level in &levels {
                let mut o = vec![0f32; m * n];
                fs.push(Box::new(move || {
                    dot_block_with(level, case.ty, w, m, x, n, &mut o)
                }));
            }
            if streaming {
                fs.push(Box::new(move || read_all(w)));
            }
            let secs = race(&mut fs);
            let weights = (m * cols) as f64;
            let base = secs[0];
            let row = |path: &str, secs: f64| {
                println!(
                    "{:<24} {:>8} {:>2} {:>10.1} {:>9.2} {:>9.2} {:>9.2}",
                    case.label,
                    path,
                    n,
                    secs * 1e6,
                    weights / secs / 1e9,
                    weights * n as f64 / secs / 1e9,
                    base / secs
                );
            };
            row("baseline", base);
            for (&level, &secs) in levels.iter().zip(&secs[1..]) {
                row(level.name(), secs);
            }
            if streaming {
                let read = secs[levels.len() + 1];
                println!(
                    "{:<24} {:>8} {:>2} {:>10.1} {:>9.2}  (plain read: {:.1} GB/s at {per:.4} B/weight; \
                     best path reaches {:.0}% of it)",
                    case.label,
                    "read",
                    n,
                    read * 1e6,
                    weights / read / 1e9,
                    w.len() as f64 / read / 1e9,
                    100.0 * read / secs[1..=levels.len()].iter().copied().fold(f64::INFINITY, f64::min)
                );
            }
        }
    }
}
