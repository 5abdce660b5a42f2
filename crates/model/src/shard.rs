//! Tensor parallelism's split of a model over the ranks of one host (Megatron-style): each rank
//! holds a slice of the attention heads and of the MLP's intermediate features, so a layer needs
//! two sums over the ranks (all-reduces), after the output projection and after the down
//! projection; everything else is computed from replicated values.
//!
//! - q/k/v: the rank's heads (`n_heads / world` query and `n_kv_heads / world` kv heads, each
//!   rank keeping whole GQA groups), rows of the matrices and their biases. The rank's KV cache
//!   holds only its kv heads.
//! - o: the columns that read the rank's heads (row-parallel: each rank gives a partial sum).
//! - gate/up: the rank's rows of the intermediate features; down: the matching columns.
//! - Norms, the embedding, the output head and the biases of o and down are replicated: a
//!   backend adds those biases once, to the sum of the ranks' partial products.
//! - EXL3 layers split only on their 128-wide Hadamard blocks (heads of 128 do; a model whose
//!   slices would cut a block is refused with the layer named).

use anyhow::{ensure, Context, Result};

use crate::config::QkNorm;
use crate::weights::{LayerWeights, Linear, LinearWeight, Weights};
use crate::ModelConfig;

/// One rank's part of a model split over `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    /// Whether `cfg` splits evenly over `world` ranks, and a clear reason where it does not.
    pub fn check(cfg: &ModelConfig, world: usize) -> Result<()> {
        ensure!(world >= 1, "tensor parallelism over 0 ranks");
        if world == 1 {
            return Ok(());
        }
        ensure!(
            cfg.n_kv_heads.is_multiple_of(world),
            "{} kv heads do not split over {world} ranks",
            cfg.n_kv_heads
        );
        ensure!(
            cfg.intermediate.is_multiple_of(world),
            "{} intermediate features do not split over {world} ranks",
            cfg.intermediate
        );
        ensure!(
            cfg.qk_norm != QkNorm::Whole,
            "a q/k norm over all heads (olmo2) needs the heads of every rank: not split"
        );
        Ok(())
    }

    /// The rank's configuration: its share of the heads and of the intermediate features.
    pub fn config(&self, cfg: &ModelConfig) -> ModelConfig {
        ModelConfig {
            n_heads: cfg.n_heads / self.world,
            n_kv_heads: cfg.n_kv_heads / self.world,
            intermediate: cfg.intermediate / self.world,
            ..cfg.clone()
        }
    }

    /// This rank's slice of a ranks-many range of `n` (`n` divisible by the world).
    fn range(&self, n: usize) -> (usize, usize) {
        let per = n / self.world;
        (self.rank * per, per)
    }

    /// The rank's weights (row slices are views of the same memory map; column slices are
    /// copied).
    pub fn weights(&self, cfg: &ModelConfig, w: &Weights) -> Result<Weights> {
        Self::check(cfg, self.world)?;
        ensure!(
            self.rank < self.world,
            "rank {} of {}",
            self.rank,
            self.world
        );
        if self.world == 1 {
            return Ok(w.clone());
        }
        let hd = cfg.head_dim;
        let q = self.range(cfg.n_heads * hd);
        let kv = self.range(cfg.n_kv_heads * hd);
        let ff = self.range(cfg.intermediate);
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| -> Result<LayerWeights> {
                let at = |what: &str| format!("layer {l} {what}");
                Ok(LayerWeights {
                    q: rows(&lw.q, q, &at("q"))?,
                    k: rows(&lw.k, kv, &at("k"))?,
                    v: rows(&lw.v, kv, &at("v"))?,
                    o: cols(&lw.o, q, &at("o"))?,
                    gate: lw
                        .gate
                        .as_ref()
                        .map(|g| rows(g, ff, &at("gate")))
                        .transpose()?,
                    up: rows(&lw.up, ff, &at("up"))?,
                    down: cols(&lw.down, ff, &at("down"))?,
                    ..lw.clone()
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Weights {
            embed: w.embed.clone(),
            layers,
            final_norm: w.final_norm.clone(),
            lm_head: w.lm_head.clone(),
        })
    }
}

/// Output rows `start..start + n` (and the bias's).
fn rows(l: &Linear, (start, n): (usize, usize), what: &str) -> Result<Linear> {
    let w = match &l.w {
        LinearWeight::Ggml(m) => {
            ensure!(
                start + n <= m.rows,
                "{what}: rows {start}+{n} of {}",
                m.rows
            );
            LinearWeight::Ggml(m.rows_view(start, n))
        }
        LinearWeight::Exl3(e) => LinearWeight::Exl3(e.outputs(start, n).context(what.to_string())?),
    };
    Ok(Linear {
        w,
        b: l.b.as_ref().map(|b| b[start..start + n].to_vec()),
    })
}

/// Input columns `start..start + n` (the bias, added to the ranks' sum, is kept whole).
fn cols(l: &Linear, (start, n): (usize, usize), what: &str) -> Result<Linear> {
    let w = match &l.w {
        LinearWeight::Ggml(m) => {
            LinearWeight::Ggml(m.cols_copy(start, n).context(what.to_string())?)
        }
        LinearWeight::Exl3(e) => LinearWeight::Exl3(e.inputs(start, n).context(what.to_string())?),
    };
    Ok(Linear { w, b: l.b.clone() })
}
