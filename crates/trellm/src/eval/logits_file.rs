//! A reference model's next-token distributions, saved by `trellm eval --save-logits` and read
//! by `--kl-base`. The layout is the one llama-perplexity's `--kl-divergence-base` writes, so
//! either tool reads the other's files (all little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | `_logits_` |
//! | 4 | `ctx` (u32): tokens a chunk |
//! | 4 | `vocab` (i32) |
//! | 4 | `chunks` (i32) |
//! | 4 · ctx · chunks | the text's tokens (i32), `ctx` a chunk, as tokenized (before BOS replaces a chunk's first) |
//! | per chunk, `ctx - 1 - ctx/2` rows of `nv = 2·⌈vocab/2⌉ + 4` u16 | one row per scored position |
//!
//! A row is `scale` (f32) and `min` (f32) in its first four u16, then one u16 `q` per token
//! (padded to an even count): `log p(i) = scale · q(i) + min`. `min` is the log-probability 16
//! nats below the most likely token (or the least likely token's, if higher): tokens below it
//! are stored as `q = 0` and count as absent. The resolution is 16 / 65535 nats.
//!
//! Reading checks every size against the file's length before allocating: a truncated, padded
//! or corrupt file, or one for another vocabulary, is an error naming what is wrong.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::stats::RowNorm;

const MAGIC: &[u8; 8] = b"_logits_";
const HEADER: u64 = 20;
/// Log-probabilities kept below the most likely token's (nats).
const RANGE: f32 = 16.0;
/// The largest chunk a file may declare (beyond any context trellm runs).
pub const MAX_CTX: usize = 1 << 20;

/// u16 values a row takes.
fn row_len(vocab: usize) -> usize {
    2 * vocab.div_ceil(2) + 4
}

/// Scored rows a chunk of `ctx` has.
fn rows(ctx: usize) -> usize {
    ctx - 1 - ctx / 2
}

/// One saved distribution.
pub struct BaseRow<'a> {
    scale: f32,
    min: f32,
    q: &'a [u16],
}

impl BaseRow<'_> {
    pub fn log_prob(&self, i: usize) -> f32 {
        self.scale * self.q[i] as f32 + self.min
    }
}

/// Encodes one row of logits into `out` (`row_len(vocab)` values).
fn encode_row(logits: &[f32], out: &mut [u16]) {
    let norm = RowNorm::of(logits);
    let lowest = logits.iter().copied().fold(f32::INFINITY, f32::min);
    let min_logit = lowest.max(norm.max - RANGE);
    let min = min_logit - norm.max - norm.log_sum_exp;
    let scale = (norm.max - min_logit) / 65535.0;
    let (s, m) = (scale.to_le_bytes(), min.to_le_bytes());
    out[0] = u16::from_le_bytes([s[0], s[1]]);
    out[1] = u16::from_le_bytes([s[2], s[3]]);
    out[2] = u16::from_le_bytes([m[0], m[1]]);
    out[3] = u16::from_le_bytes([m[2], m[3]]);
    let q = &mut out[4..];
    q.fill(0);
    if scale > 0.0 {
        let inv = 1.0 / scale;
        for (o, &l) in q.iter_mut().zip(logits) {
            if l > min_logit {
                *o = (inv * (l - min_logit)).round_ties_even().min(65535.0) as u16;
            }
        }
    }
}

fn write_err(path: &Path, e: std::io::Error) -> anyhow::Error {
    anyhow::anyhow!("--save-logits: cannot write {}: {e}", path.display())
}

/// Writes a file: the header and tokens at creation, then each chunk's scored rows in order.
pub struct Writer {
    w: BufWriter<File>,
    path: PathBuf,
    vocab: usize,
    ctx: usize,
    chunks_left: usize,
    row: Vec<u16>,
    bytes: Vec<u8>,
}

impl Writer {
    /// `tokens`: `ctx · chunks` of them.
    pub fn create(
        path: &Path,
        ctx: usize,
        vocab: usize,
        chunks: usize,
        tokens: &[u32],
    ) -> Result<Writer> {
        let (c, v, n) = (
            u32::try_from(ctx)?,
            i32::try_from(vocab)?,
            i32::try_from(chunks)?,
        );
        anyhow::ensure!(tokens.len() == ctx * chunks, "token count");
        let f = File::create(path)
            .with_context(|| format!("--save-logits: cannot create {}", path.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let mut head = Vec::with_capacity(HEADER as usize + tokens.len() * 4);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&c.to_le_bytes());
        head.extend_from_slice(&v.to_le_bytes());
        head.extend_from_slice(&n.to_le_bytes());
        for &t in tokens {
            head.extend_from_slice(&(t as i32).to_le_bytes());
        }
        w.write_all(&head).map_err(|e| write_err(path, e))?;
        Ok(Writer {
            w,
            path: path.to_path_buf(),
            vocab,
            ctx,
            chunks_left: chunks,
            row: vec![0; row_len(vocab)],
            bytes: Vec::new(),
        })
    }

    fn err(&self, e: std::io::Error) -> anyhow::Error {
        write_err(&self.path, e)
    }

    /// A chunk's scored rows (`rows(ctx)` of `vocab` logits).
    pub fn chunk(&mut self, logits: &[f32]) -> Result<()> {
        anyhow::ensure!(self.chunks_left > 0, "more chunks than the header says");
        anyhow::ensure!(logits.len() == rows(self.ctx) * self.vocab, "row count");
        for row in logits.chunks_exact(self.vocab) {
            encode_row(row, &mut self.row);
            self.bytes.clear();
            self.bytes
                .extend(self.row.iter().flat_map(|v| v.to_le_bytes()));
            let r = self.w.write_all(&self.bytes);
            r.map_err(|e| self.err(e))?;
        }
        self.chunks_left -= 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<()> {
        anyhow::ensure!(self.chunks_left == 0, "fewer chunks than the header says");
        let r = self.w.flush().and_then(|()| self.w.get_ref().sync_all());
        r.map_err(|e| self.err(e))
    }
}

/// An opened base file: its header and tokens read and checked, rows read chunk by chunk.
pub struct BaseFile {
    r: BufReader<File>,
    pub ctx: usize,
    pub vocab: usize,
    pub chunks: usize,
    pub tokens: Vec<u32>,
    buf: Vec<u8>,
    q: Vec<u16>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_bits(u32_at(b, at))
}

impl BaseFile {
    /// Opens `path` for a model of `vocab` logits.
    pub fn open(path: &Path, vocab: usize) -> Result<BaseFile> {
        let name = path.display();
        let f = File::open(path).with_context(|| format!("--kl-base: cannot open {name}"))?;
        let len = f.metadata()?.len();
        let mut r = BufReader::with_capacity(1 << 20, f);
        let mut head = [0u8; HEADER as usize];
        if len < HEADER || r.read_exact(&mut head).is_err() {
            bail!("--kl-base: {name} is too short to be a logits file ({len} bytes)");
        }
        if &head[..8] != MAGIC {
            bail!("--kl-base: {name} is not a logits file (it does not start with _logits_)");
        }
        let ctx = u32_at(&head, 8) as usize;
        let file_vocab = u32_at(&head, 12) as i32;
        let chunks = u32_at(&head, 16) as i32;
        if file_vocab as i64 != vocab as i64 {
            bail!(
                "--kl-base: {name} holds distributions over {file_vocab} tokens, the model has {vocab}: another model's vocabulary"
            );
        }
        if !(3..=MAX_CTX).contains(&ctx) || chunks < 1 {
            bail!("--kl-base: {name} has a corrupt header (ctx {ctx}, chunks {chunks})");
        }
        let chunks = chunks as usize;
        let nv = row_len(vocab) as u64;
        let want = (ctx as u64)
            .checked_mul(chunks as u64)
            .and_then(|t| t.checked_mul(4))
            .and_then(|t| {
                (rows(ctx) as u64)
                    .checked_mul(nv * 2)?
                    .checked_mul(chunks as u64)?
                    .checked_add(t)
            })
            .and_then(|t| t.checked_add(HEADER));
        if want != Some(len) {
            bail!(
                "--kl-base: {name} is {len} bytes, its header (ctx {ctx}, vocab {vocab}, {chunks} chunks) needs {}: truncated or corrupt",
                want.map_or("more than 2^64".to_string(), |w| w.to_string())
            );
        }
        // Sizes below are now bounded by the file's length.
        let mut raw = vec![0u8; ctx * chunks * 4];
        r.read_exact(&mut raw)
            .with_context(|| format!("--kl-base: reading {name}"))?;
        let tokens: Vec<u32> = raw.chunks_exact(4).map(|b| u32_at(b, 0)).collect();
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!(
                "--kl-base: {name} holds token id {} outside the vocabulary of {vocab}",
                *t as i32
            );
        }
        // Every row's scale and offset are checked now, so a corrupt file fails before any
        // chunk runs.
        let rows_at = HEADER + raw.len() as u64;
        for k in 0..chunks * rows(ctx) {
            let mut h = [0u8; 8];
            r.read_exact(&mut h)
                .with_context(|| format!("--kl-base: reading {name}"))?;
            let (scale, min) = (f32_at(&h, 0), f32_at(&h, 4));
            if !(scale.is_finite() && scale >= 0.0 && min.is_finite() && min <= 0.0) {
                bail!("--kl-base: {name} has a corrupt row {k} (scale {scale}, min {min})");
            }
            r.seek_relative(nv as i64 * 2 - 8)?;
        }
        r.seek(SeekFrom::Start(rows_at))?;
        Ok(BaseFile {
            r,
            ctx,
            vocab,
            chunks,
            tokens,
            buf: Vec::new(),
            q: Vec::new(),
        })
    }

    /// Scored rows a chunk has.
    pub fn rows(&self) -> usize {
        rows(self.ctx)
    }

    /// Reads the next chunk's rows (call [`Self::row`] for each).
    pub fn next_chunk(&mut self) -> Result<()> {
        let n = self.rows() * row_len(self.vocab);
        self.buf.resize(n * 2, 0);
        self.r
            .read_exact(&mut self.buf)
            .context("--kl-base: reading the base file")?;
        self.q.clear();
        self.q.extend(
            self.buf
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]])),
        );
        Ok(())
    }

    /// Row `j` of the chunk last read.
    pub fn row(&self, j: usize) -> BaseRow<'_> {
        let nv = row_len(self.vocab);
        let r = &self.q[j * nv..(j + 1) * nv];
        let f = |a: u16, b: u16| {
            let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
            f32::from_le_bytes([a[0], a[1], b[0], b[1]])
        };
        BaseRow {
            scale: f(r[0], r[1]),
            min: f(r[2], r[3]),
            q: &r[4..4 + self.vocab],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_within_the_resolution() {
        let logits: Vec<f32> = (0..101)
            .map(|i| ((i * 37) % 101) as f32 * 0.2 - 5.0)
            .collect();
        let mut out = vec![0u16; row_len(101)];
        assert_eq!(out.len(), 2 * 51 + 4);
        encode_row(&logits, &mut out);
        let norm = RowNorm::of(&logits);
        let f = |a: u16, b: u16| {
            let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
            f32::from_le_bytes([a[0], a[1], b[0], b[1]])
        };
        let row = BaseRow {
            scale: f(out[0], out[1]),
            min: f(out[2], out[3]),
            q: &out[4..105],
        };
        for (i, _) in logits.iter().enumerate() {
            let want = norm.log_prob(&logits, i);
            if want > norm.log_prob(&logits, norm.argmax) - RANGE {
                assert!((row.log_prob(i) - want).abs() < 2e-4, "{i}");
            }
        }
    }
}
