//! `trellm eval`: perplexity against a direct computation, KL divergence of a model against
//! itself, and bad input (texts, flags, base files) failing with one error line.

mod common;

use common::*;
use trellm::backend::SoloSequence;
use trellm_model::Want;

/// About 330 tokens of plain English (enough for 5 chunks of 64).
const TEXT: &str = "The river rises in the hills north of the town and runs south through a \
narrow valley of farms and woods before it reaches the sea. In the eighteenth century its banks \
held a dozen mills, which ground grain for the markets of three counties and later spun cotton \
and wool. The first bridge was built of timber in 1742; a flood carried it away twenty years \
later, and the stone bridge that replaced it still carries the main road. When the railway came \
in 1851 the mills lost their trade to larger factories in the cities, and most of them closed \
within a generation. Some were turned into houses, one became a school, and the largest is now \
a museum of local history, where visitors can see the old water wheel turning again.\n\
The town itself grew up around a market square. Its church, begun in the twelfth century, has \
a tower that can be seen from every part of the valley, and its records of births, marriages \
and deaths go back more than four hundred years. In the square stand the old market hall, two \
inns and a row of shops whose fronts were rebuilt in the Victorian style. Every summer the town \
holds a fair with music, games and a procession of boats on the river, a custom said to be as \
old as the bridge. Most people now work in the nearby city or in the tourist trade, but a few \
farms in the valley still keep sheep and cattle, and the hills above them are crossed by \
footpaths that walkers follow for miles along the ridge.\n";

fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.to_str().unwrap().to_string()
}

fn eval_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["eval", "--json", "--quiet"];
    all.extend_from_slice(args);
    let (code, out, err) = run(&all);
    assert_eq!(code, 0, "{all:?}: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The perplexity of `TEXT` in chunks of `ctx`, computed here: each chunk in one forward pass
/// over the whole chunk, BOS first where the tokenizer adds it, f64 log-softmax by hand over the
/// second half.
fn direct_ppl(ctx: usize) -> (f64, usize) {
    let m = trellm::load(&model_path("smollm2-135m-instruct")).unwrap();
    let tok = m.tokenizer().unwrap();
    let text = TEXT.strip_suffix('\n').unwrap();
    let ids = tok.encode(text, true).unwrap();
    let vocab = m.model.cfg.vocab;
    let (mut nll, mut n) = (0.0f64, 0usize);
    for c in 0..ids.len() / ctx {
        let mut chunk = ids[c * ctx..(c + 1) * ctx].to_vec();
        if tok.add_bos() {
            chunk[0] = tok.bos_id().unwrap();
        }
        let mut seq = SoloSequence::new(&*m.model, ctx).unwrap();
        let logits = seq.forward(&chunk, Want::All).unwrap();
        for j in ctx / 2..ctx - 1 {
            let row = &logits[j * vocab..(j + 1) * vocab];
            let max = row.iter().fold(f64::MIN, |a, &v| a.max(v as f64));
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[ids[c * ctx + j + 1] as usize] as f64;
            n += 1;
        }
    }
    ((nll / n as f64).exp(), n)
}

#[test]
fn perplexity_matches_a_direct_computation() {
    let d = tempfile::tempdir().unwrap();
    let f = write(d.path(), "t.txt", TEXT.as_bytes());
    let (want, n) = direct_ppl(64);
    let j = eval_json(&["--file", &f, "--ctx", "64"]);
    assert_eq!(j["tokens"].as_u64().unwrap() as usize, n, "{j}");
    assert_eq!(j["chunks"].as_u64().unwrap() as usize, n / 31, "{j}");
    let got = j["ppl"].as_f64().unwrap();
    assert!(
        (got / want - 1.0).abs() < 1e-4,
        "eval {got} against direct {want}"
    );
    // A real model on plain English: far below the vocabulary's 49152.
    assert!(got > 1.5 && got < 200.0, "{got}");
    // --chunks limits the chunks; more than the text holds is all of them.
    let j2 = eval_json(&["--file", &f, "--ctx", "64", "--chunks", "2"]);
    assert_eq!(j2["tokens"], 62);
    let j3 = eval_json(&["--file", &f, "--ctx", "64", "--chunks", "1000"]);
    assert_eq!(j3["tokens"], j["tokens"]);
}

#[test]
fn strided_perplexity_scores_the_last_stride() {
    let d = tempfile::tempdir().unwrap();
    let f = write(d.path(), "t.txt", TEXT.as_bytes());
    let j = eval_json(&[
        "--file", &f, "--ctx", "64", "--stride", "32", "--chunks", "3",
    ]);
    assert_eq!(j["tokens"], 96, "{j}");
    assert!(j["ppl"].as_f64().unwrap() > 1.5);
}

#[test]
fn kl_divergence_of_a_model_against_itself_is_zero() {
    let d = tempfile::tempdir().unwrap();
    let f = write(d.path(), "t.txt", TEXT.as_bytes());
    let base = d.path().join("base.bin");
    let b = base.to_str().unwrap();
    let plain = eval_json(&["--file", &f, "--ctx", "64", "--save-logits", b]);
    // Header, tokens, and rows of 2 * (vocab / 2) + 4 u16 per scored token.
    let (chunks, tokens) = (
        plain["chunks"].as_u64().unwrap(),
        plain["tokens"].as_u64().unwrap(),
    );
    let size = 20 + 4 * 64 * chunks + tokens * (49152 + 4) * 2;
    assert_eq!(std::fs::metadata(&base).unwrap().len(), size);
    for args in [vec!["--kl-base", b], vec!["--kl-base", b, "--file", &f]] {
        let j = eval_json(&args);
        assert_eq!(j["tokens"], plain["tokens"], "{j}");
        // The same tokens through the same model: the same perplexity.
        let (p, p0) = (j["ppl"].as_f64().unwrap(), plain["ppl"].as_f64().unwrap());
        assert!((p / p0 - 1.0).abs() < 1e-9, "{p} vs {p0}");
        // The saved log-probabilities are rounded to 16/65535 nats: zero up to that.
        let kld = j["kld_mean"].as_f64().unwrap();
        assert!(kld.abs() < 1e-5, "{j}");
        assert!(j["kld"]["max"].as_f64().unwrap() < 1e-4, "{j}");
        assert_eq!(j["same_top"], 1.0, "{j}");
        assert!((j["ppl_ratio"].as_f64().unwrap() - 1.0).abs() < 1e-3, "{j}");
    }
    // The text table ends with llama-perplexity's summary.
    let (code, out, err) = run(&["eval", "--kl-base", b, "-q"]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "Mean    KLD:",
        "99.9%   KLD:",
        "Median  KLD:",
        "Same top p: 100.000",
        "Mean PPL(Q)/PPL(base)",
    ] {
        assert!(out.contains(needle), "{needle} missing: {out}");
    }
}

#[test]
fn bad_texts_and_flags_fail_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let empty = write(d.path(), "empty.txt", b"\n");
    let short = write(d.path(), "short.txt", b"Hello there.");
    let binary = write(d.path(), "bin.txt", &[0xff, 0xfe, 0x00, 0x41]);
    let f = write(d.path(), "t.txt", TEXT.as_bytes());
    assert_clean_error(&["eval", "--file", "/nonexistent/text.txt"], "cannot read");
    assert_clean_error(&["eval", "--file", &empty], "empty");
    assert_clean_error(&["eval", "--file", &short], "one chunk");
    assert_clean_error(&["eval", "--file", &binary], "UTF-8");
    assert_clean_error(&["eval"], "--file");
    assert_clean_error(&["eval", "--file", &f, "--ctx", "2"], "--ctx");
    assert_clean_error(&["eval", "--file", &f, "--ctx", "99999999"], "--ctx");
    assert_clean_error(
        &["eval", "--file", &f, "--ctx", "64", "--stride", "64"],
        "--stride",
    );
    assert_clean_error(&["eval", "--file", &f, "--chunks", "0"], "--chunks");
    assert_clean_error(&["eval", "--file", &f, "--device", "cuda"], "--ubatch 1");
    assert_clean_error(
        &["eval", "--model", "/nonexistent/m.gguf", "--file", &f],
        "no such file",
    );
}

#[test]
fn bad_base_files_fail_cleanly() {
    let d = tempfile::tempdir().unwrap();
    let f = write(d.path(), "t.txt", TEXT.as_bytes());
    let base = d.path().join("base.bin");
    let b = base.to_str().unwrap();
    eval_json(&[
        "--file",
        &f,
        "--ctx",
        "64",
        "--chunks",
        "2",
        "--save-logits",
        b,
    ]);
    let good = std::fs::read(&base).unwrap();
    let kl = |name: &str, bytes: &[u8], needle: &str| {
        let p = write(d.path(), name, bytes);
        assert_clean_error(&["eval", "--kl-base", &p], needle);
    };
    assert_clean_error(
        &["eval", "--kl-base", "/nonexistent/base.bin"],
        "cannot open",
    );
    kl("tiny.bin", &good[..10], "too short");
    kl(
        "magic.bin",
        &[b"_garbage".as_slice(), &good[8..]].concat(),
        "not a logits file",
    );
    kl("cut.bin", &good[..good.len() - 1], "truncated");
    kl(
        "long.bin",
        &[good.as_slice(), &[0u8; 4]].concat(),
        "truncated or corrupt",
    );
    // Another vocabulary.
    let mut v = good.clone();
    v[12..16].copy_from_slice(&32000i32.to_le_bytes());
    kl("vocab.bin", &v, "vocabulary");
    // Counts that would size huge allocations are refused against the file's length.
    let mut c = good.clone();
    c[16..20].copy_from_slice(&i32::MAX.to_le_bytes());
    kl("chunks.bin", &c, "truncated or corrupt");
    let mut c = good.clone();
    c[16..20].copy_from_slice(&(-1i32).to_le_bytes());
    kl("neg.bin", &c, "corrupt header");
    let mut c = good.clone();
    c[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    kl("ctx.bin", &c, "corrupt header");
    // A token id outside the vocabulary, and a row whose scale is not a number.
    let mut t = good.clone();
    t[20..24].copy_from_slice(&1_000_000i32.to_le_bytes());
    kl("token.bin", &t, "outside the vocabulary");
    let mut r = good.clone();
    let rows_at = 20 + 4 * 64 * 2;
    r[rows_at..rows_at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    kl("nan.bin", &r, "corrupt row");
    // A text that is not the base file's, and a --ctx it was not saved with.
    let other = write(d.path(), "o.txt", TEXT.replace("river", "canal").as_bytes());
    assert_clean_error(
        &["eval", "--kl-base", b, "--file", &other],
        "does not tokenize",
    );
    assert_clean_error(&["eval", "--kl-base", b, "--ctx", "128"], "--ctx 128");
    assert_clean_error(&["eval", "--kl-base", b, "--stride", "8"], "--stride");
}
