//! Calibration: which text, cut into rows of tokens, and the second-moment matrices
//! `H = sum x x^T` of each linear layer's input rows that LDLQ weighs the rounding error by.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// The default calibration text (relative to the working directory, as the project's other
/// data paths are): wikitext-2's test split, of which only the first [`DEFAULT_FRACTION`] of the
/// lines is used, so perplexity and KL divergence can be measured on the rest.
pub const DEFAULT_TEXT: &str = "../shared/data/wikitext-2-raw-test.raw";
/// The share of the default text's lines used for calibration: the first 40%, the part
/// llama.cpp's importance matrices for the quality comparison are computed from
/// (`../shared/research/quality-anchors-smollm2.md`); evaluation takes the last 20% or 40%.
pub const DEFAULT_FRACTION: f64 = 0.4;
/// Calibration texts larger than this are refused.
const MAX_TEXT_BYTES: u64 = 1 << 30;

/// The calibration text and a description of it for `config.json`.
pub struct Text {
    pub text: String,
    pub describe: String,
}

/// The default file's first 40% of lines, or a user's whole file.
pub fn text(file: Option<&Path>) -> Result<Text> {
    let (path, default) = match file {
        Some(p) => (p, false),
        None => (Path::new(DEFAULT_TEXT), true),
    };
    let name = path.display();
    let meta = std::fs::metadata(path).with_context(|| {
        if default {
            format!(
                "the default calibration text {name} is not here (run from the repository, or \
                 pass --calibration FILE, or --calib-rows 0 for none)"
            )
        } else {
            format!("--calibration: cannot read {name}")
        }
    })?;
    if meta.len() > MAX_TEXT_BYTES {
        bail!(
            "--calibration: {name} is {} bytes, more than 1 GiB",
            meta.len()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {name}"))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("--calibration: {name} is not UTF-8 text ({e})"))?;
    if !default {
        if text.trim().is_empty() {
            bail!("--calibration: {name} is empty");
        }
        return Ok(Text {
            describe: format!("{name} (whole file)"),
            text,
        });
    }
    let (head, used, total) = first_lines(&text, DEFAULT_FRACTION);
    Ok(Text {
        text: head,
        describe: format!(
            "{} lines 1-{used} of {total} (first 40%, \\r removed, split on \\n)",
            path.file_name().unwrap_or_default().to_string_lossy()
        ),
    })
}

/// `\r` removed, split on `\n`, the first `floor(fraction * n)` lines joined with `\n`; with
/// the count used and the total (Python's `t.replace('\r', '').split('\n')[:int(0.4 * n)]`).
pub fn first_lines(text: &str, fraction: f64) -> (String, usize, usize) {
    let clean = text.replace('\r', "");
    let lines: Vec<&str> = clean.split('\n').collect();
    let used = (fraction * lines.len() as f64) as usize;
    (lines[..used].join("\n"), used, lines.len())
}

/// Rows of at most `cols` tokens (BOS first where the model adds one), at most `rows` of them;
/// a shorter final row is kept (a small calibration set is still a calibration set).
pub fn rows(tokens: &[u32], bos: Option<u32>, rows: usize, cols: usize) -> Vec<Vec<u32>> {
    let take = cols - usize::from(bos.is_some());
    let mut out = Vec::new();
    for chunk in tokens.chunks(take.max(1)) {
        if out.len() == rows {
            break;
        }
        let mut r = Vec::with_capacity(cols);
        r.extend(bos);
        r.extend_from_slice(chunk);
        out.push(r);
    }
    out
}

/// Rows per f32 product before it is added to the f64 sum: small enough that the f32 partial
/// sums lose nothing that matters, large enough for the GEMM to run at speed.
const CHUNK_ROWS: usize = 2048;

/// `H = sum x x^T` over the finite input rows seen (`dim x dim`, f64), with the count of rows
/// left out because they held inf or NaN. Only the lower triangle is summed (H is symmetric);
/// [`Hessian::padded`] gives the whole matrix.
pub struct Hessian {
    pub dim: usize,
    /// Row-major; entries above the diagonal are not kept up to date.
    h: Vec<f64>,
    pub rows: usize,
    pub skipped: usize,
    buf: Vec<f32>,
    prod: Vec<f32>,
}

/// Rows of H computed by one GEMM of the lower triangle (each band up to its last column).
const BAND: usize = 128;

impl Hessian {
    pub fn new(dim: usize) -> Hessian {
        Hessian {
            dim,
            h: vec![0.0; dim * dim],
            rows: 0,
            skipped: 0,
            buf: Vec::with_capacity(CHUNK_ROWS * dim),
            prod: vec![0.0; dim * dim],
        }
    }

    /// Adds the rows of `x` (`[m][dim]`).
    pub fn add(&mut self, x: &[f32]) {
        for row in x.chunks_exact(self.dim) {
            if row.iter().all(|v| v.is_finite()) {
                self.buf.extend_from_slice(row);
                if self.buf.len() == CHUNK_ROWS * self.dim {
                    self.flush();
                }
            } else {
                self.skipped += 1;
            }
        }
        self.flush();
    }

    fn flush(&mut self) {
        let (d, m) = (self.dim, self.buf.len() / self.dim);
        if m == 0 {
            return;
        }
        for i0 in (0..d).step_by(BAND) {
            let i1 = (i0 + BAND).min(d);
            // SAFETY: dst is rows i0..i1, columns 0..i1 of the d x d `prod` (row stride d); lhs =
            // X^T's rows i0..i1 (element (i, p) = buf[p d + i0 + i]), rhs = X's columns 0..i1
            // (element (p, j) = buf[p d + j]), X being m x d: all in bounds.
            unsafe {
                gemm::gemm(
                    i1 - i0,
                    i1,
                    m,
                    self.prod.as_mut_ptr().add(i0 * d),
                    1,
                    d as isize,
                    false,
                    self.buf.as_ptr().add(i0),
                    d as isize,
                    1,
                    self.buf.as_ptr(),
                    1,
                    d as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(rayon::current_num_threads()),
                );
            }
        }
        let lower = |i: usize| i * d..i * d + i + 1;
        // A product of squares can overflow f32 even from finite rows; such a chunk is
        // recounted as skipped rather than poisoning H.
        if (0..d).all(|i| self.prod[lower(i)].iter().all(|v| v.is_finite())) {
            for i in 0..d {
                self.h[lower(i)]
                    .iter_mut()
                    .zip(&self.prod[lower(i)])
                    .for_each(|(h, &p)| *h += p as f64);
            }
            self.rows += m;
        } else {
            self.skipped += m;
        }
        self.buf.clear();
    }

    /// `H` zero-padded to `k x k` (inputs exllamav3 pads to 128s are never active).
    pub fn padded(&self, k: usize) -> Vec<f64> {
        let d = self.dim;
        let mut out = vec![0.0; k * k];
        for i in 0..d {
            for j in 0..d {
                out[i * k + j] = self.h[i.max(j) * d + i.min(j)];
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hessian_matches_a_plain_sum_and_skips_non_finite_rows() {
        let d = 5;
        let x: Vec<f32> = (0..7 * d)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0)
            .collect();
        let mut bad = x.clone();
        bad[2 * d + 1] = f32::NAN;
        bad[4 * d] = f32::INFINITY;
        let mut h = Hessian::new(d);
        h.add(&bad);
        assert_eq!((h.rows, h.skipped), (5, 2));
        for i in 0..d {
            for j in 0..d {
                let want: f64 = (0..7)
                    .filter(|&r| r != 2 && r != 4)
                    .map(|r| x[r * d + i] as f64 * x[r * d + j] as f64)
                    .sum();
                assert!((h.padded(d)[i * d + j] - want).abs() < 1e-5, "{i} {j}");
            }
        }
    }

    #[test]
    fn rows_and_lines() {
        let t: Vec<u32> = (10..20).collect();
        assert_eq!(
            rows(&t, Some(1), 3, 4),
            vec![
                vec![1, 10, 11, 12],
                vec![1, 13, 14, 15],
                vec![1, 16, 17, 18]
            ]
        );
        assert_eq!(rows(&t, None, 9, 4).last().unwrap(), &vec![18, 19]);
        let (head, used, total) = first_lines("a\r\nb\r\nc\r\nd\r\ne\r\n", 0.4);
        assert_eq!((head.as_str(), used, total), ("a\nb", 2, 6));
    }
}
