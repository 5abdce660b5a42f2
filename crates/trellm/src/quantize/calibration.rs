//! Calibration: which text, cut into rows of tokens, and the second-moment matrices
//! `H = sum x x^T` of each linear layer's input rows that LDLQ weighs the rounding error by.

use std::path::Path;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;

use crate::backend::cpu::SendPtr;

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

/// Calibration rows read as tokens, and a description of them for `config.json`.
pub struct TokenRows {
    pub rows: Vec<Vec<u32>>,
    pub describe: String,
}

/// Token rows from a safetensors file, the calibration exllamav3's `--cal_data` takes: an
/// `input_ids` tensor `[rows][cols]` (I32 or I64) and optionally `lengths` `[rows]` (a row's
/// tokens from position 0, right-padded). Each row cropped to `cols`, the first `rows` kept;
/// an id outside the vocabulary is an error (the file was made with another tokenizer).
pub fn token_rows(path: &Path, rows: usize, cols: usize, vocab: usize) -> Result<TokenRows> {
    let name = path.display();
    let st = trellm_formats::safetensors::SafeTensors::open(path)
        .with_context(|| format!("--calibration: cannot read {name}"))?;
    let ints = |tensor: &str| -> Result<Option<(Vec<usize>, Vec<i64>)>> {
        let Some(t) = st.get(tensor) else {
            return Ok(None);
        };
        let bytes = st.data(t);
        let width = match t.dtype_name.as_str() {
            "I32" => 4,
            "I64" => 8,
            other => bail!("--calibration: {name}: {tensor} is {other}, not I32 or I64"),
        };
        let count: usize = t.shape.iter().product();
        if bytes.len() != count * width {
            bail!(
                "--calibration: {name}: {tensor} holds {} bytes for shape {:?}",
                bytes.len(),
                t.shape
            );
        }
        let values = bytes
            .chunks_exact(width)
            .map(|b| match width {
                4 => i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64,
                _ => i64::from_le_bytes(b.try_into().expect("8 bytes")),
            })
            .collect();
        Ok(Some((t.shape.clone(), values)))
    };
    let Some((shape, ids)) = ints("input_ids")? else {
        bail!("--calibration: {name} has no input_ids tensor");
    };
    let [n, width] = shape[..] else {
        bail!("--calibration: {name}: input_ids has shape {shape:?}, not [rows, cols]");
    };
    let lengths = ints("lengths")?;
    if let Some((s, _)) = &lengths {
        if s[..] != [n] {
            bail!("--calibration: {name}: lengths has shape {s:?}, not [{n}]");
        }
    }
    let mut out = Vec::new();
    for r in 0..n.min(rows) {
        let len = lengths
            .as_ref()
            .map_or(width, |(_, l)| l[r].clamp(0, width as i64) as usize);
        let row = &ids[r * width..r * width + len.min(cols)];
        if row.is_empty() {
            bail!("--calibration: {name}: row {r} is empty");
        }
        if let Some(&bad) = row.iter().find(|&&t| t < 0 || t as usize >= vocab) {
            bail!(
                "--calibration: {name}: row {r} holds token id {bad}, outside the model's \
                 vocabulary of {vocab} (made with another tokenizer?)"
            );
        }
        out.push(row.iter().map(|&t| t as u32).collect());
    }
    Ok(TokenRows {
        describe: format!(
            "{name} (token rows: {} of {n}, up to {} tokens each)",
            out.len(),
            cols.min(width)
        ),
        rows: out,
    })
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

/// Rows and columns of H one GEMM of the lower triangle computes.
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
        let d = self.dim;
        // The usual case, a chunk of finite rows: multiplied where it lies.
        if x.len() <= CHUNK_ROWS * d && x.par_iter().all(|v| v.is_finite()) {
            self.accumulate(x);
            return;
        }
        for row in x.chunks_exact(d) {
            if row.iter().all(|v| v.is_finite()) {
                self.buf.extend_from_slice(row);
                if self.buf.len() == CHUNK_ROWS * d {
                    self.flush();
                }
            } else {
                self.skipped += 1;
            }
        }
        self.flush();
    }

    fn flush(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        self.accumulate(&buf);
        self.buf = buf;
        self.buf.clear();
    }

    /// Adds `x x^T` of the finite rows `x` (at most [`CHUNK_ROWS`] of them).
    fn accumulate(&mut self, x: &[f32]) {
        let (d, m) = (self.dim, x.len() / self.dim);
        if m == 0 {
            return;
        }
        // The lower triangle's BAND x BAND blocks, a task each, biggest rows first: as one GEMM
        // per band of rows (the gemm crate splitting each over the threads), the small bands
        // left threads waiting.
        let bands = d.div_ceil(BAND);
        let blocks: Vec<(usize, usize)> = (0..bands)
            .rev()
            .flat_map(|bi| (0..=bi).map(move |bj| (bi, bj)))
            .collect();
        let prod = SendPtr(self.prod.as_mut_ptr());
        blocks.into_par_iter().for_each(|(bi, bj)| {
            let (i0, j0) = (bi * BAND, bj * BAND);
            let (i1, j1) = ((i0 + BAND).min(d), (j0 + BAND).min(d));
            // SAFETY: dst is rows i0..i1, columns j0..j1 of the d x d `prod` (row stride d), which
            // no other task writes; lhs = X^T's rows i0..i1 (element (i, p) = x[p d + i0 + i]),
            // rhs = X's columns j0..j1 (element (p, j) = x[p d + j0 + j]), X being m x d: all in
            // bounds.
            unsafe {
                gemm::gemm(
                    i1 - i0,
                    j1 - j0,
                    m,
                    prod.get().add(i0 * d + j0),
                    1,
                    d as isize,
                    false,
                    x.as_ptr().add(i0),
                    d as isize,
                    1,
                    x.as_ptr().add(j0),
                    1,
                    d as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
        // A product of squares can overflow f32 even from finite rows; such a chunk is
        // recounted as skipped rather than poisoning H.
        let finite = self
            .prod
            .par_chunks(d)
            .enumerate()
            .all(|(i, r)| r[..=i].iter().all(|v| v.is_finite()));
        if finite {
            self.h
                .par_chunks_mut(d)
                .zip(self.prod.par_chunks(d))
                .enumerate()
                .for_each(|(i, (h, p))| {
                    h[..=i]
                        .iter_mut()
                        .zip(&p[..=i])
                        .for_each(|(h, &p)| *h += p as f64)
                });
            self.rows += m;
        } else {
            self.skipped += m;
        }
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
    fn token_rows_read_ids_and_lengths_and_refuse_foreign_ids() {
        use crate::quantize::folder::{write_safetensors, Tensor};
        let dir = std::env::temp_dir().join(format!("trellm-cal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, tensors: &[Tensor]| {
            let p = dir.join(name);
            write_safetensors(&p, &tensors.iter().collect::<Vec<_>>()).unwrap();
            p
        };
        let i64s = |name: &str, shape: Vec<usize>, v: &[i64]| Tensor {
            name: name.into(),
            dtype: "I64".into(),
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let ids = i64s(
            "input_ids",
            vec![3, 4],
            &[5, 6, 7, 8, 9, 10, 0, 0, 1, 2, 3, 4],
        );
        let p = file(
            "a.safetensors",
            &[ids, i64s("lengths", vec![3], &[4, 2, 4])],
        );
        let t = token_rows(&p, 10, 3, 100).unwrap();
        assert_eq!(t.rows, vec![vec![5, 6, 7], vec![9, 10], vec![1, 2, 3]]);
        assert_eq!(
            token_rows(&p, 1, 8, 100).unwrap().rows,
            vec![vec![5, 6, 7, 8]]
        );
        let e = token_rows(&p, 10, 8, 9).err().unwrap().to_string();
        assert!(
            e.contains("token id 9") && e.contains("vocabulary of 9"),
            "{e}"
        );

        let i32s = Tensor {
            name: "input_ids".into(),
            dtype: "I32".into(),
            shape: vec![1, 2],
            bytes: [3i32, 4].iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let p = file("b.safetensors", &[i32s]);
        assert_eq!(token_rows(&p, 5, 8, 10).unwrap().rows, vec![vec![3, 4]]);
        let p = file("c.safetensors", &[i64s("ids", vec![1, 1], &[1])]);
        let e = token_rows(&p, 5, 8, 10).err().unwrap().to_string();
        assert!(e.contains("no input_ids"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
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
