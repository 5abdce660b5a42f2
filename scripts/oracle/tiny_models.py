#!/usr/bin/env python3
"""Tiny seeded-random models and mlx-lm's greedy outputs on them: the per-architecture oracle
that `crates/trellm/tests/tiny_oracle.rs` checks trellm against.

For every entry of MODELS below this writes tests/fixtures/tiny/<name>/:
  config.json        the Hugging Face config (model_type, architectures, tie_word_embeddings, ...)
  model.safetensors  float32 weights under Hugging Face tensor names (no tokenizer files)
  oracle.json        {"oracle": "mlx-lm X, mlx Y, CPU float32", "model": name,
                      "cases": [{"id", "prompt_ids", "greedy_ids",
                                 "steps": [{"token", "top": [[id, logprob], ...20]}, ...],
                                 "step0_logprobs": [logprob of every vocab id at step 0]}]}
Each model is built by mlx-lm from its config, given seeded random weights, saved, then reloaded
with mlx_lm.utils.load_model (strict, so every saved name must be one mlx-lm expects) and run
with mlx_lm.generate.generate_step, greedy (temp 0), from random prompt ids, as in
/work/shared/oracle/greedy_goldens.py. Generation stops after STEPS tokens or at an EOS id.

Run (from the repository root; Linux x86-64, CPU only, takes seconds):
    python3 -m venv /tmp/oracle && /tmp/oracle/bin/pip install "mlx[cpu]" mlx-lm numpy
    /tmp/oracle/bin/python scripts/oracle/tiny_models.py [--out tests/fixtures/tiny] [--check] [NAME ...]
With no NAME, every model is (re)written. --check also reruns each case in float64 and prints
how far mlx-lm's float32 logprobs are from it: the floor any float32 engine is held to, which
must stay well below the test's 1e-4 (tune a new model's Scales until it is ~1e-5). The output is deterministic for a given mlx/mlx-lm
version (weights and prompts come from numpy's seeded PCG64). CI never runs this: the
fixtures are committed.

Adding a model: append an entry to MODELS (name, seed, the HF config, prompt lengths). A new
family also needs an entry in FAMILIES: its HF architecture name, whether its norms store w for
a (1 + w) scale, and a name map if mlx-lm's parameter names differ from the checkpoint's (the
reload checks names against what mlx-lm's sanitize() accepts, not against HF itself).
RoPE tables (every rope_scaling variant, bit for bit) come from rope_tables.py beside this.
"""
import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import _get_classes, load_model

STEPS = 32  # greedy steps per case
TOP = 20  # top-K logprobs recorded per step


@dataclass
class FamilySpec:
    architecture: str  # config.json "architectures"
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w): store small w, not w near 1
    # mlx-lm parameter name -> checkpoint (HF) name; identity where they agree.
    to_hf: Callable[[str], str] = lambda n: n
    # Config keys every checkpoint of this family carries (the model's own entries override).
    defaults: Dict = field(default_factory=dict)


FAMILIES: Dict[str, FamilySpec] = {
    "llama": FamilySpec(
        "LlamaForCausalLM",
        defaults={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "max_position_embeddings": 2048, "rope_scaling": None},
    ),
    "gemma3_text": FamilySpec(
        "Gemma3ForCausalLM",
        norm_plus_one=True,
        defaults={"hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
                  "attn_logit_softcapping": None, "final_logit_softcapping": None,
                  "rope_scaling": None},
    ),
    "mistral": FamilySpec(
        "MistralForCausalLM",
        defaults={"hidden_act": "silu", "max_position_embeddings": 32768, "rope_scaling": None},
    ),
    "smollm3": FamilySpec(
        "SmolLM3ForCausalLM",
        defaults={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "max_position_embeddings": 2048, "rope_scaling": None},
    ),
    "qwen2": FamilySpec(
        "Qwen2ForCausalLM",
        defaults={"hidden_act": "silu", "max_position_embeddings": 32768, "rope_scaling": None},
    ),
    "qwen3": FamilySpec(
        "Qwen3ForCausalLM",
        defaults={"hidden_act": "silu", "max_position_embeddings": 40960, "rope_scaling": None,
                  "attention_bias": False},
    ),
    "gemma": FamilySpec(
        "GemmaForCausalLM", norm_plus_one=True,
        defaults={"hidden_act": "gelu", "max_position_embeddings": 8192},
    ),
    "gemma2": FamilySpec(
        "Gemma2ForCausalLM", norm_plus_one=True,
        defaults={"hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192},
    ),
    "phi3": FamilySpec(
        "Phi3ForCausalLM",
        defaults={"hidden_act": "silu", "max_position_embeddings": 131072,
                  "original_max_position_embeddings": 4096},
    ),
    "olmo2": FamilySpec(
        "Olmo2ForCausalLM",
        defaults={"hidden_act": "silu", "attention_bias": False, "max_position_embeddings": 4096,
                  "rope_scaling": None},
    ),
    "granite": FamilySpec(
        "GraniteForCausalLM",
        defaults={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "max_position_embeddings": 4096, "rope_scaling": None},
    ),
    "starcoder2": FamilySpec(
        "Starcoder2ForCausalLM",
        defaults={"hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
                  "use_bias": True},
    ),
}


@dataclass
class Scales:
    """Weight scales. Linear weights are N(0, gain^2 / fan_in). Chosen so that no single path
    dominates (attention neither uniform nor one-hot, next-token distributions neither flat nor
    certain, greedy continuations not stuck repeating a token), yet the model stays well
    conditioned: mlx-lm's float32 logprobs stay within ~1e-5 of the same model run in float64,
    so a correct float32 engine can be held to 1e-4. Sharper attention or larger activations
    quickly push that float32 noise towards 1e-4."""
    embed: float = 0.3  # std of embedding entries
    qk_gain: float = 1.0
    gain: float = 1.5  # v, o, mlp
    head_gain: float = 2.0  # untied lm_head
    norm: float = 0.1  # std of norm weights around their neutral value
    # Added to the norm weights of the named modules (e.g. to make gemma's post-norms scale
    # the layer outputs up against the embedding, which the tied lm_head would otherwise
    # favour: every token predicting itself).
    norm_shift: Dict[str, float] = field(default_factory=dict)
    bias: float = 0.1


@dataclass
class ModelSpec:
    name: str
    seed: int
    config: Dict  # HF config.json entries (model_type first); family defaults fill the rest
    prompt_lens: List[int]
    scales: Scales = field(default_factory=Scales)


MODELS: List[ModelSpec] = [
    # Plain llama: tied embeddings, GQA 4/2, head_dim = hidden / heads.
    ModelSpec(
        "llama", seed=1,
        config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # Untied lm_head; head_dim (32) != hidden / heads (16); MQA (1 kv head); eps 1e-6;
    # rope_theta 500000.
    ModelSpec(
        "llama-untied", seed=2,
        config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6,
                "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2},
        prompt_lens=[7, 23, 38],
        scales=Scales(qk_gain=1.5, gain=1.0),
    ),
    # Gemma 3: sliding window 8 (smaller than most prompts and than prompt + generation),
    # pattern 3 over 4 layers (sliding, sliding, global, sliding), local/global rope bases,
    # query_pre_attn_scalar (20) != head_dim (16) != hidden / heads (24), hidden 96 so that
    # sqrt(hidden) = 9.798 rounds to 9.8125 in bfloat16. Tied embeddings (no lm_head tensor).
    ModelSpec(
        "gemma3", seed=3,
        config={"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 96,
                "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 20,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "sliding_window": 8, "sliding_window_pattern": 3,
                "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"],
                "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1},
        prompt_lens=[5, 12, 37],
        # Gemma's sandwich norms pin each layer's output to rms ~1 and q/k norms pin attention
        # scores; scaling them up keeps the model from echoing its input token (tied lm_head)
        # and its attention from being near-uniform.
        scales=Scales(embed=0.15, gain=1.0,
                      norm_shift={"post_attention_layernorm": 4.0, "post_feedforward_layernorm": 4.0,
                                  "q_norm": 0.5, "k_norm": 0.5}),
    ),
    # llama with llama3 rope scaling; original context 16 so the scaling bites at these lengths.
    ModelSpec(
        "llama-rope-llama3", seed=11,
        config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # yarn (with mscale) and the traditional (interleaved) layout.
    ModelSpec(
        "llama-rope-yarn", seed=12,
        config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "rope_traditional": True,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                 "mscale": 1.0, "mscale_all_dim": 0.5},
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # dynamic NTK: prompts fit max_position_embeddings (24), generation runs past it.
    ModelSpec(
        "llama-rope-dynamic", seed=13,
        config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "max_position_embeddings": 24,
                "rope_scaling": {"type": "dynamic", "factor": 4.0},
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 24],
    ),
    # linear scaling, q/k/v/o and MLP biases.
    ModelSpec(
        "llama-rope-linear-bias", seed=34,
        config={"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "rope_scaling": {"type": "linear", "factor": 2.0}, "attention_bias": True,
                "mlp_bias": True, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # mistral: read as llama (sliding_window unused, as in mlx-lm), untied, head_dim 32.
    ModelSpec(
        "mistral", seed=15,
        config={"model_type": "mistral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0, "sliding_window": 4096, "tie_word_embeddings": False,
                "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[6, 19, 40],
    ),
    # smollm3: NoPE in every 2nd layer of 4.
    ModelSpec(
        "smollm3", seed=36,
        config={"model_type": "smollm3", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "no_rope_layer_interval": 2, "tie_word_embeddings": True, "bos_token_id": 1,
                "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # qwen2: q/k/v biases, tied.
    ModelSpec(
        "qwen2", seed=17,
        config={"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # qwen3: per-head q/k norms, head_dim 32 != 64 / 4, untied.
    ModelSpec(
        "qwen3", seed=38,
        config={"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
        scales=Scales(norm_shift={"q_norm": 0.5, "k_norm": 0.5}),
    ),
    # gemma: (1 + w) norms, sqrt(hidden) embedding scale, exact GELU, MQA, head_dim 32.
    ModelSpec(
        "gemma", seed=19,
        config={"model_type": "gemma", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "bos_token_id": 2, "eos_token_id": 1},
        prompt_lens=[5, 17, 40],
        scales=Scales(embed=0.15, gain=1.0),
    ),
    # gemma2: sandwich norms, attention and final soft-capping small enough to bite.
    ModelSpec(
        "gemma2", seed=20,
        config={"model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0,
                "final_logit_softcapping": 15.0, "sliding_window": 4096,
                "bos_token_id": 2, "eos_token_id": 1},
        prompt_lens=[5, 17, 40],
        scales=Scales(embed=0.1, gain=1.5,
                      norm_shift={"post_attention_layernorm": 4.0, "post_feedforward_layernorm": 4.0}),
    ),
    # phi3: fused qkv / gate_up, partial rotary (half), longrope with per-pair long factors.
    ModelSpec(
        "phi3", seed=21,
        config={"model_type": "phi3", "vocab_size": 256, "hidden_size": 64,
                "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                                 "long_factor": [1.0, 1.5, 3.0, 8.0]},
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # olmo2: post-norms only, q/k norms over the whole projections.
    ModelSpec(
        "olmo2", seed=22,
        config={"model_type": "olmo2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
        scales=Scales(norm_shift={"q_norm": 0.5, "k_norm": 0.5}),
    ),
    # granite: embedding, residual, attention and logits multipliers.
    ModelSpec(
        "granite", seed=43,
        config={"model_type": "granite", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "embedding_multiplier": 2.0, "residual_multiplier": 0.8,
                "attention_multiplier": 0.2, "logits_scaling": 1.5,
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
    # starcoder2: LayerNorm with bias, plain exact-GELU MLP, biases everywhere.
    ModelSpec(
        "starcoder2", seed=24,
        config={"model_type": "starcoder2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "norm_epsilon": 1e-5, "rope_theta": 100000.0,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
        prompt_lens=[5, 17, 40],
    ),
]


def full_config(spec: ModelSpec) -> Dict:
    fam = FAMILIES[spec.config["model_type"]]
    cfg = {"architectures": [fam.architecture], **fam.defaults, **spec.config,
           "torch_dtype": "float32"}
    return cfg


def random_weights(model, spec: ModelSpec, rng: np.random.Generator) -> Dict[str, mx.array]:
    """Seeded random values for every parameter of `model`, in its (deterministic) tree order."""
    fam = FAMILIES[spec.config["model_type"]]
    s = spec.scales
    out = {}
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        leaf = name.split(".")[-2] if "." in name else name
        if name.endswith(".bias"):
            w = rng.standard_normal(shape) * s.bias
        elif len(shape) == 1 and "norm" in leaf:
            w = rng.standard_normal(shape) * s.norm + (0.0 if fam.norm_plus_one else 1.0)
            w += s.norm_shift.get(leaf, 0.0)
        elif leaf == "embed_tokens":
            w = rng.standard_normal(shape) * s.embed
        elif len(shape) == 2:
            gain = {"q_proj": s.qk_gain, "k_proj": s.qk_gain, "lm_head": s.head_gain}.get(leaf, s.gain)
            w = rng.standard_normal(shape) * (gain / np.sqrt(shape[1]))
        else:
            raise ValueError(f"no init rule for parameter {name} {shape}")
        out[name] = mx.array(w.astype(np.float32))
    return out


def build(spec: ModelSpec, out_dir: Path):
    """Builds the model with mlx-lm, writes config.json and model.safetensors; returns
    (config, rng) so that the prompts continue the same random stream."""
    cfg = full_config(spec)
    fam = FAMILIES[cfg["model_type"]]
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    rng = np.random.default_rng(spec.seed)
    weights = random_weights(model, spec, rng)
    tied = cfg.get("tie_word_embeddings", True)
    tensors = {fam.to_hf(n): w for n, w in weights.items() if not (tied and n == "lm_head.weight")}
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "config.json", "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(sorted(tensors.items())),
                        metadata={"format": "pt"})
    return cfg, rng


def f32(x) -> float:
    """A float32 value as the shortest decimal that reads back as the same float32."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="0"))


def run_case(model, cid: str, ids: List[int], eos: set, vocab: int) -> Dict:
    steps = []
    step0 = None
    for (t, logprobs), _ in zip(generate_step(mx.array(ids), model, max_tokens=STEPS,
                                              sampler=make_sampler(temp=0.0)), range(STEPS)):
        lp = np.array(logprobs.astype(mx.float32))
        assert lp.shape == (vocab,), lp.shape
        if step0 is None:
            step0 = [f32(v) for v in lp]
        top = np.argsort(-lp, kind="stable")[:TOP]
        steps.append({"token": int(t), "top": [[int(i), f32(lp[i])] for i in top]})
        if int(t) in eos:
            break
    return {"id": cid, "prompt_ids": ids, "greedy_ids": [s["token"] for s in steps],
            "steps": steps, "step0_logprobs": step0}


def dump_oracle(oracle: Dict) -> str:
    """JSON with one line per step (compact, yet diffable)."""
    j = lambda v: json.dumps(v, separators=(",", ":"))
    cases = []
    for c in oracle["cases"]:
        steps = ",\n".join("  " + j(s) for s in c["steps"])
        cases.append(f'{{"id":{j(c["id"])},\n "prompt_ids":{j(c["prompt_ids"])},\n'
                     f' "greedy_ids":{j(c["greedy_ids"])},\n "steps":[\n{steps}],\n'
                     f' "step0_logprobs":{j(c["step0_logprobs"])}}}')
    head = {k: v for k, v in oracle.items() if k != "cases"}
    out = j(head)[:-1] + ',\n"cases":[\n' + ",\n".join(cases) + "]}\n"
    assert json.loads(out) == oracle
    return out


def summarize(name: str, cases: List[Dict]) -> None:
    for c in cases:
        gaps = [s["top"][0][1] - s["top"][1][1] for s in c["steps"]]
        p_top = [float(np.exp(s["top"][0][1])) for s in c["steps"]]
        print(f"  {name}/{c['id']}: prompt {len(c['prompt_ids'])}, {len(c['greedy_ids'])} steps, "
              f"{len(set(c['greedy_ids']))} distinct tokens, top-1 p {min(p_top):.2f}..{max(p_top):.2f}, "
              f"min top-2 gap {min(gaps):.2e}")


def float64_drift(out_dir: Path, cases: List[Dict]) -> float:
    """Max |float32 oracle - float64 rerun| over the recorded top logprobs, following each
    case's greedy path (until the float64 run picks another token)."""
    model, _ = load_model(out_dir)
    model.set_dtype(mx.float64)
    worst = 0.0
    for c in cases:
        for (t, lp), st in zip(generate_step(mx.array(c["prompt_ids"]), model,
                                             max_tokens=len(c["steps"]),
                                             sampler=make_sampler(temp=0.0)), c["steps"]):
            lp = np.array(lp)
            worst = max(worst, max(abs(float(lp[i]) - v) for i, v in st["top"]))
            if int(t) != st["token"]:
                break
    return worst


def make(spec: ModelSpec, root: Path, check: bool = False) -> None:
    out_dir = root / spec.name
    cfg, rng = build(spec, out_dir)
    model, loaded_cfg = load_model(out_dir)  # strict: names and shapes must match
    vocab = cfg["vocab_size"]
    e = cfg.get("eos_token_id", [])
    eos = set(e if isinstance(e, list) else [e])
    specials = eos | {cfg.get("bos_token_id")}
    cases = []
    for i, n in enumerate(spec.prompt_lens):
        ids = []
        while len(ids) < n:
            t = int(rng.integers(0, vocab))
            if t not in specials:
                ids.append(t)
        cases.append(run_case(model, f"p{i}-len{n}", ids, eos, vocab))
    oracle = {"oracle": f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}, CPU float32",
              "model": spec.name, "cases": cases}
    with open(out_dir / "oracle.json", "w") as f:
        f.write(dump_oracle(oracle))
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"{spec.name}: {size / 1024:.0f} KiB in {out_dir}")
    summarize(spec.name, cases)
    if check:
        print(f"  {spec.name}: float32 vs float64 max logprob diff {float64_drift(out_dir, cases):.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="models to write (default: all)")
    ap.add_argument("--out", default="tests/fixtures/tiny")
    ap.add_argument("--check", action="store_true", help="report float32 vs float64 drift")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    known = {m.name: m for m in MODELS}
    for n in a.names:
        if n not in known:
            raise SystemExit(f"unknown model {n}; known: {', '.join(known)}")
    for spec in MODELS:
        if not a.names or spec.name in a.names:
            make(spec, Path(a.out), a.check)


if __name__ == "__main__":
    main()
