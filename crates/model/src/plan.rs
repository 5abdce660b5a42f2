//! The plan: a decoder layer as a list of ops, built once from [`ModelConfig`]. Every backend
//! executes it op by op, so a family's switches are read in one place; the fusions a backend
//! makes (RoPE and the KV write in the qkv epilogue, the residual add in the output
//! projection's) are described here as data, not rediscovered by each backend.

use crate::config::{Activation, Mlp, ModelConfig, Norm, QkNorm};
use crate::rope::Rope;

/// A norm over the hidden vector.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormOp {
    pub kind: Norm,
    pub eps: f32,
}

/// What follows the q/k/v projections (with their biases, if any).
#[derive(Debug, Clone, PartialEq)]
pub struct QkvEpilogue {
    pub q_dim: usize,
    pub kv_dim: usize,
    pub head_dim: usize,
    pub qk_norm: QkNorm,
    pub norm_eps: f32,
    /// None: no positional encoding in this layer (NoPE).
    pub rope: Option<Rope>,
}

/// Causal attention of the new queries over the sequence's cached keys and values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOp {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplier on q·k.
    pub scale: f32,
    /// Scores become `cap * tanh(s / cap)`.
    pub softcap: Option<f32>,
    /// Attend only to the last `n` positions (the current one included).
    pub window: Option<usize>,
}

/// How a projection's output joins the residual stream: `x += scale * post_norm(y)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidualEpilogue {
    pub post_norm: Option<NormOp>,
    pub scale: Option<f32>,
}

/// The MLP's activation: `act(gate) * up` (gated) or `act(up)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GluEpilogue {
    pub activation: Activation,
    pub gated: bool,
}

/// One step of a layer, in execution order. `x` is the residual stream, `xn` its normed copy.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `xn = norm(x)` with the layer's attention norm, or `xn = x` where there is none.
    AttnNorm(Option<NormOp>),
    /// `q, k, v = xn W (+ b)`, then the epilogue; k and v are written to the KV cache.
    Qkv(QkvEpilogue),
    Attention(AttentionOp),
    /// The output projection of the attention, added to `x`.
    Output(ResidualEpilogue),
    /// `xn = norm(x)` with the layer's MLP norm, or `xn = x`.
    MlpNorm(Option<NormOp>),
    /// `h = act(xn W_gate) * (xn W_up)` or `act(xn W_up)`.
    GateUp(GluEpilogue),
    /// The down projection of `h`, added to `x`.
    Down(ResidualEpilogue),
}

#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub ops: Vec<Op>,
}

/// Post-processing of the output projection's logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitsOp {
    /// `cap * tanh(l / cap)`.
    pub softcap: Option<f32>,
    /// Divided by this (granite).
    pub divisor: Option<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The token embedding is multiplied by this.
    pub embed_scale: Option<f32>,
    pub layers: Vec<LayerPlan>,
    pub final_norm: NormOp,
    pub logits: LogitsOp,
}

impl Plan {
    pub fn new(cfg: &ModelConfig) -> Plan {
        let norm = NormOp {
            kind: cfg.norm,
            eps: cfg.norm_eps,
        };
        let pre = cfg.pre_norms.then_some(norm);
        let residual = ResidualEpilogue {
            post_norm: cfg.post_norms.then_some(norm),
            scale: cfg.residual_scale,
        };
        let layers = cfg
            .layers
            .iter()
            .map(|spec| LayerPlan {
                ops: vec![
                    Op::AttnNorm(pre),
                    Op::Qkv(QkvEpilogue {
                        q_dim: cfg.n_heads * cfg.head_dim,
                        kv_dim: cfg.n_kv_heads * cfg.head_dim,
                        head_dim: cfg.head_dim,
                        qk_norm: cfg.qk_norm,
                        norm_eps: cfg.norm_eps,
                        rope: spec.rope.clone(),
                    }),
                    Op::Attention(AttentionOp {
                        n_heads: cfg.n_heads,
                        n_kv_heads: cfg.n_kv_heads,
                        head_dim: cfg.head_dim,
                        scale: cfg.attn_scale,
                        softcap: cfg.attn_softcap,
                        window: spec.sliding_window,
                    }),
                    Op::Output(residual),
                    Op::MlpNorm(pre),
                    Op::GateUp(GluEpilogue {
                        activation: cfg.activation,
                        gated: cfg.mlp == Mlp::Gated,
                    }),
                    Op::Down(residual),
                ],
            })
            .collect();
        Plan {
            embed_scale: cfg.embed_scale,
            layers,
            final_norm: norm,
            logits: LogitsOp {
                softcap: cfg.final_softcap,
                divisor: cfg.logits_divisor,
            },
        }
    }
}
