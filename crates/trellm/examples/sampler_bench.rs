//! Sampling cost per token on a real model's next-token logits (gemma-3-270m: 262144 entries),
//! for the filters mlx-lm offers, next to top-p's full comparison sort (its exact twin).
//!
//!     cargo run --release -p trellm --example sampler_bench [-- MODEL]

use std::time::Instant;

use trellm::backend::SoloSequence;
use trellm::engine::sampler::{apply_top_p, apply_top_p_full, Sampler, SamplerParams};
use trellm_model::Want;

fn ms_per_call(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() * 1e3 / reps as f64
}

fn main() {
    let name = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "gemma-3-270m".into());
    let path = trellm_hub::resolve_model(&name, false).expect("model");
    let m = trellm::model::load::load(&path).expect("loads");
    let ids = [2u32, 818, 5279, 529, 506, 12498, 563];
    let logits = SoloSequence::new(&*m.model, ids.len())
        .and_then(|mut s| s.forward(&ids, Want::Last))
        .expect("runs");
    println!(
        "{name}: {} logits, ms a token (logprobs + filters + draw)",
        logits.len()
    );
    let base = SamplerParams {
        temp: 0.7,
        seed: Some(1),
        ..Default::default()
    };
    for (label, p) in [
        ("temp 0.7", base.clone()),
        (
            "temp 0.7, top-p 0.9",
            SamplerParams {
                top_p: 0.9,
                ..base.clone()
            },
        ),
        (
            "temp 0.7, top-k 40",
            SamplerParams {
                top_k: 40,
                ..base.clone()
            },
        ),
        (
            "temp 0.7, min-p 0.05",
            SamplerParams {
                min_p: 0.05,
                ..base.clone()
            },
        ),
    ] {
        let mut s = Sampler::new(p);
        let ms = ms_per_call(20, || {
            let mut lp = logits.clone();
            s.logprobs(&mut lp, &ids);
            std::hint::black_box(s.sample(&lp));
        });
        println!("  {label:<22} {ms:6.2}");
    }
    let mut lp = logits.clone();
    trellm::backend::cpu::log_softmax(&mut lp);
    let fast = ms_per_call(20, || apply_top_p(&mut lp.clone(), 0.9));
    let full = ms_per_call(20, || apply_top_p_full(&mut lp.clone(), 0.9));
    println!("  top-p 0.9 filter alone: {fast:.2} (candidates, radix sort) vs {full:.2} (full comparison sort)");
}
