//! The quantizer's calibration passes (`CpuModel::forward_layer` by half-layers, with
//! `finish_half`) against the plain pass they stand in for, on every tiny family (post-norms,
//! biases, q/k norms, soft-caps among them): a half finished from the input its last projection
//! was shown gives bit for bit the rows a whole `Tail::Residual` pass gives, and an inputs-only
//! pass shows the same first input as a full one and leaves the rows as they were.

use std::path::PathBuf;

use trellm::backend::cpu::model::{Tail, Tap};
use trellm::backend::cpu::CpuModel;
use trellm::model::load::load;
use trellm::model::plan::Op;

fn fixtures() -> Vec<PathBuf> {
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny"
    ));
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    v.sort();
    v
}

/// Hidden rows with the spread a residual stream has (a few large values).
fn rows(m: usize, h: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..m * h)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 37 == 0 {
                8.0 * u
            } else {
                2.0 * u
            }
        })
        .collect()
}

#[test]
fn finished_halves_equal_whole_passes() {
    let mut checked = 0;
    for path in fixtures() {
        let lm = load(&path).unwrap();
        let model: &CpuModel = &lm.model;
        let h = model.cfg.hidden;
        for (l, layer) in model.plan.layers.iter().enumerate() {
            let ops = &layer.ops;
            let split = ops
                .iter()
                .position(|o| matches!(o, Op::MlpNorm(_)))
                .unwrap();
            let lw = &model.weights.layers[l];
            for (half, first, last) in [
                (&ops[..split], Tap::Qkv, Tap::O),
                (&ops[split..], Tap::GateUp, Tap::Down),
            ] {
                let name = format!("{} layer {l} {first:?}", path.display());
                let x0 = rows(37, h, l as u64 + 1);
                let mut whole = x0.clone();
                let mut shown_full = None;
                model
                    .forward_layer(half, lw, &mut whole, Tail::Residual, &mut |t, input| {
                        if t == first {
                            shown_full = Some(input.to_vec());
                        }
                    })
                    .unwrap();

                let mut x = x0.clone();
                let mut shown_first = None;
                model
                    .forward_layer(half, lw, &mut x, Tail::InputOnly, &mut |t, input| {
                        assert_eq!(t, first, "{name}: an inputs-only pass went on");
                        shown_first = Some(input.to_vec());
                    })
                    .unwrap();
                assert!(x == x0, "{name}: an inputs-only pass changed the rows");
                assert!(shown_first.is_some() && shown_first == shown_full, "{name}");

                let mut kept = None;
                model
                    .forward_layer(half, lw, &mut x, Tail::TapOnly, &mut |t, input| {
                        if t == last {
                            kept = Some(input.to_vec());
                        }
                    })
                    .unwrap();
                assert!(x == x0, "{name}: a tap-only pass changed the rows");
                model
                    .finish_half(half.last().unwrap(), lw, &kept.unwrap(), &mut x)
                    .unwrap();
                assert!(x != x0, "{name}: the half added nothing");
                assert!(
                    x == whole,
                    "{name}: finished half differs from a whole pass"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 30, "{checked} halves checked");
}

#[test]
fn finish_half_refuses_what_is_not_a_last_projection() {
    let path = &fixtures()[0];
    let lm = load(path).unwrap();
    let model: &CpuModel = &lm.model;
    let h = model.cfg.hidden;
    let ops = &model.plan.layers[0].ops;
    let mut x = rows(4, h, 9);
    let err = model
        .finish_half(&ops[0], &model.weights.layers[0], &x.clone(), &mut x)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("not a half-layer's last projection"),
        "{err}"
    );
    let down = ops.last().unwrap();
    let err = model
        .finish_half(down, &model.weights.layers[0], &[0.0; 3], &mut x)
        .unwrap_err();
    assert!(err.to_string().contains("finish_half"), "{err}");
}
