//! SentencePiece-style vocabularies stored in GGUF (`tokenizer.ggml.model = "llama"`), tokenized the
//! way llama.cpp does it, since that is the reference for these files: special and user-defined
//! pieces are cut out of the text first (longest piece first), spaces become `▁`, then adjacent
//! symbols are merged greedily by the score of the merged piece, and characters that never form a
//! piece become `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use aho_corasick::{AhoCorasick, MatchKind};

use crate::TokenizerError;

/// The SentencePiece whitespace marker.
pub(crate) const SPACE: &str = "\u{2581}";

/// GGUF `tokenizer.ggml.token_type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte(u8),
}

impl Kind {
    pub(crate) fn from_gguf(ty: i64, piece: &str) -> Kind {
        match ty {
            2 => Kind::Unknown,
            3 => Kind::Control,
            4 => Kind::UserDefined,
            5 => Kind::Unused,
            6 => parse_byte_piece(piece).map_or(Kind::Normal, Kind::Byte),
            _ => Kind::Normal,
        }
    }
}

/// `<0xAB>` -> 0xAB.
pub(crate) fn parse_byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

pub(crate) struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<Kind>,
    lookup: HashMap<String, u32>,
    byte_ids: [Option<u32>; 256],
    /// Pieces cut out of the text before merging, longest first (llama.cpp's order).
    specials: Vec<u32>,
    /// Finds which of `specials` occur at all, so the partition only loops over those.
    special_finder: Option<AhoCorasick>,
    add_space_prefix: bool,
    unk: Option<u32>,
}

enum Fragment {
    Text(usize, usize),
    Token(u32),
}

#[derive(Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

// Highest score first, then the leftmost pair (llama.cpp's priority queue order; scores compare
// like C floats, so -0.0 == 0.0).
impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .partial_cmp(&o.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| o.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}

impl Spm {
    pub(crate) fn new(
        pieces: Vec<String>,
        scores: Vec<f32>,
        kinds: Vec<Kind>,
        add_space_prefix: bool,
        unk: Option<u32>,
    ) -> Result<Spm, TokenizerError> {
        let n = pieces.len();
        if scores.len() != n || kinds.len() != n {
            return Err(TokenizerError::Invalid(format!(
                "vocabulary has {n} pieces but {} scores and {} token types",
                scores.len(),
                kinds.len()
            )));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::Invalid(format!(
                "vocabulary too large ({n})"
            )));
        }
        let mut lookup = HashMap::with_capacity(n);
        for (id, p) in pieces.iter().enumerate() {
            // Later duplicates win, as in llama.cpp's token_to_id map.
            lookup.insert(p.clone(), id as u32);
        }
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = lookup.get(&format!("<0x{b:02X}>")).copied().or_else(|| {
                std::str::from_utf8(&[b as u8])
                    .ok()
                    .and_then(|s| lookup.get(s).copied())
            });
        }
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&id| {
                matches!(
                    kinds[id as usize],
                    Kind::Control | Kind::UserDefined | Kind::Unknown
                ) && !pieces[id as usize].is_empty()
            })
            .collect();
        specials.sort_by(|&a, &b| pieces[b as usize].len().cmp(&pieces[a as usize].len()));
        let special_finder = if specials.is_empty() {
            None
        } else {
            let pats: Vec<&str> = specials
                .iter()
                .map(|&id| pieces[id as usize].as_str())
                .collect();
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::Standard)
                    .build(pats)
                    .map_err(|e| TokenizerError::Invalid(format!("special pieces: {e}")))?,
            )
        };
        Ok(Spm {
            pieces,
            scores,
            kinds,
            lookup,
            byte_ids,
            specials,
            special_finder,
            add_space_prefix,
            unk,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.pieces.len()
    }
    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }
    pub(crate) fn kind(&self, id: u32) -> Option<Kind> {
        self.kinds.get(id as usize).copied()
    }
    pub(crate) fn token_to_id(&self, s: &str) -> Option<u32> {
        self.lookup.get(s).copied()
    }

    /// Token ids of `text` (no BOS/EOS); special-token strings in the text become those tokens.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut prev_special = true;
        let mut buf = String::new();
        for frag in self.partition(text) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(s, e) => {
                    buf.clear();
                    if self.add_space_prefix && prev_special {
                        buf.push_str(SPACE);
                    }
                    for c in text[s..e].chars() {
                        if c == ' ' {
                            buf.push_str(SPACE);
                        } else {
                            buf.push(c);
                        }
                    }
                    self.merge(&buf, out);
                    prev_special = false;
                }
            }
        }
    }

    /// Splits `text` around special pieces: for each piece, longest first, every occurrence in
    /// the remaining text fragments (left to right, non-overlapping) becomes a token.
    fn partition(&self, text: &str) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Fragment::Text(0, text.len())];
        let Some(finder) = &self.special_finder else {
            return frags;
        };
        let mut present = vec![false; self.specials.len()];
        let mut any = false;
        for m in finder.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
            any = true;
        }
        if !any {
            return frags;
        }
        for (rank, &id) in self.specials.iter().enumerate() {
            if !present[rank] {
                continue;
            }
            let pat = self.pieces[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(mut s, e) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(pos) = text[s..e].find(pat) {
                    let m = s + pos;
                    if m > s {
                        next.push(Fragment::Text(s, m));
                    }
                    next.push(Fragment::Token(id));
                    s = m + pat.len();
                }
                if s < e {
                    next.push(Fragment::Text(s, e));
                }
            }
            frags = next;
        }
        frags
    }

    fn try_bigram(
        &self,
        text: &str,
        syms: &[Symbol],
        l: usize,
        r: usize,
        heap: &mut BinaryHeap<Bigram>,
    ) {
        let s = syms[l].start;
        let size = syms[l].len + syms[r].len;
        if let Some(&id) = self.lookup.get(&text[s..s + size]) {
            heap.push(Bigram {
                score: self.scores[id as usize],
                left: l,
                right: r,
                size,
            });
        }
    }

    /// Greedy merge of one escaped fragment.
    fn merge(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        let Some(last) = syms.last_mut() else {
            return;
        };
        last.next = None;
        let mut heap = BinaryHeap::new();
        for i in 1..syms.len() {
            self.try_bigram(text, &syms, i - 1, i, &mut heap);
        }
        while let Some(b) = heap.pop() {
            let (ln, rn) = (syms[b.left].len, syms[b.right].len);
            // Stale: one side was merged away or grew since this pair was queued.
            if ln == 0 || rn == 0 || ln + rn != b.size {
                continue;
            }
            syms[b.left].len = b.size;
            syms[b.right].len = 0;
            let rnext = syms[b.right].next;
            syms[b.left].next = rnext;
            if let Some(n) = rnext {
                syms[n].prev = Some(b.left);
            }
            if let Some(p) = syms[b.left].prev {
                self.try_bigram(text, &syms, p, b.left, &mut heap);
            }
            if let Some(n) = rnext {
                self.try_bigram(text, &syms, b.left, n, &mut heap);
            }
        }
        let mut i = Some(0);
        while let Some(k) = i {
            let sym = &syms[k];
            let piece = &text[sym.start..sym.start + sym.len];
            if let Some(&id) = self.lookup.get(piece) {
                out.push(id);
            } else {
                // Only single characters can be missing (merges always form vocabulary pieces).
                for &b in piece.as_bytes() {
                    if let Some(id) = self.byte_ids[b as usize].or(self.unk) {
                        out.push(id);
                    }
                }
            }
            i = sym.next;
        }
    }

    /// Text of `ids` as llama.cpp detokenizes: the pieces' bytes (`▁` -> space in normal pieces,
    /// `<0xXX>` -> that byte, control pieces dropped when `skip_special`) joined, then read as
    /// UTF-8 with each invalid or unfinished sequence replaced by one U+FFFD (what Python's
    /// `errors="replace"` gives). `strip_leading` drops the space `add_space_prefix` added.
    pub(crate) fn decode(
        &self,
        ids: &[u32],
        skip_special: bool,
        strip_leading: bool,
    ) -> Result<String, TokenizerError> {
        let mut bytes: Vec<u8> = Vec::new();
        for &id in ids {
            let kind = self.kind(id).ok_or(TokenizerError::InvalidId {
                id,
                vocab_size: self.len(),
            })?;
            let piece = &self.pieces[id as usize];
            match kind {
                Kind::Byte(b) => bytes.push(b),
                Kind::Control | Kind::Unknown if skip_special => {}
                Kind::Normal | Kind::Unused => {
                    bytes.extend_from_slice(piece.replace(SPACE, " ").as_bytes())
                }
                _ => bytes.extend_from_slice(piece.as_bytes()),
            }
        }
        let mut out = String::from_utf8_lossy(&bytes).into_owned();
        if strip_leading && self.add_space_prefix && out.starts_with(' ') {
            out.remove(0);
        }
        Ok(out)
    }
}

impl Spm {
    /// This vocabulary as a `tokenizers` pipeline that tokenizes as [`Spm::encode`] does: BPE
    /// over characters with byte fallback, one merge for every way a piece splits into two
    /// pieces, ranked by the merged piece's score (llama.cpp merges the best-scored pair first,
    /// the leftmost of equals; `tokenizers` the lowest rank, the leftmost of equals);
    /// control, unknown and user-defined pieces as added tokens (cut out of the text first);
    /// spaces to `▁` (with a leading `▁` per fragment where `add_space_prefix`). This is how
    /// transformers converts SentencePiece BPE models such as Gemma's.
    pub(crate) fn to_hf(
        &self,
        bos: Option<u32>,
        add_bos: bool,
    ) -> Result<tokenizers::Tokenizer, TokenizerError> {
        use tokenizers::decoders::byte_fallback::ByteFallback;
        use tokenizers::decoders::fuse::Fuse;
        use tokenizers::decoders::sequence::Sequence as DecoderSequence;
        use tokenizers::decoders::strip::Strip;
        use tokenizers::decoders::DecoderWrapper;
        use tokenizers::models::bpe::BPE;
        use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace, Sequence};
        use tokenizers::processors::template::TemplateProcessing;
        use tokenizers::AddedToken;

        let err = |e: tokenizers::Error| TokenizerError::Backend(e.to_string());
        if self.lookup.len() != self.pieces.len() {
            return Err(TokenizerError::Unsupported(format!(
                "{} of the {} SentencePiece pieces are duplicates, which tokenizer.json cannot hold",
                self.pieces.len() - self.lookup.len(),
                self.pieces.len()
            )));
        }
        // A character outside the vocabulary becomes its bytes' pieces in both; without them
        // llama.cpp keeps it as a symbol no merge crosses, which `tokenizers` cannot do.
        if let Some(b) = (0..=255u8).find(|b| !self.lookup.contains_key(&format!("<0x{b:02X}>"))) {
            return Err(TokenizerError::Unsupported(format!(
                "the SentencePiece vocabulary has no byte piece <0x{b:02X}>, so tokenizer.json \
                 cannot split characters outside it as llama.cpp does"
            )));
        }
        // (score of the merged piece, merged id, left id, right id), best first.
        let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
        for (id, piece) in self.pieces.iter().enumerate() {
            for (i, _) in piece.char_indices().skip(1) {
                let (l, r) = piece.split_at(i);
                if let (Some(&a), Some(&b)) = (self.lookup.get(l), self.lookup.get(r)) {
                    ranked.push((self.scores[id], id as u32, a, b));
                }
            }
        }
        ranked.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
        let piece = |id: u32| self.pieces[id as usize].clone();
        let merges: Vec<(String, String)> = ranked
            .iter()
            .map(|&(_, _, a, b)| (piece(a), piece(b)))
            .collect();
        let vocab: tokenizers::models::bpe::Vocab = self
            .pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.clone(), i as u32))
            .collect();
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(true)
            .fuse_unk(true);
        if let Some(u) = self.unk {
            builder = builder.unk_token(piece(u));
        }
        let bpe = builder.build().map_err(err)?;
        let mut tok = tokenizers::Tokenizer::new(bpe);
        let replace: NormalizerWrapper = Replace::new(" ", SPACE).map_err(err)?.into();
        tok.with_normalizer(Some(if self.add_space_prefix {
            Sequence::new(vec![Prepend::new(SPACE.into()).into(), replace]).into()
        } else {
            replace
        }))
        .map_err(err)?;
        let mut decoders: Vec<DecoderWrapper> = vec![
            Replace::new(SPACE, " ").map_err(err)?.into(),
            ByteFallback::new().into(),
            Fuse::new().into(),
        ];
        if self.add_space_prefix {
            decoders.push(Strip::new(' ', 1, 0).into());
        }
        tok.with_decoder(Some(DecoderSequence::new(decoders)));
        if let (true, Some(b)) = (add_bos, bos) {
            let name = piece(b);
            let template = TemplateProcessing::builder()
                .try_single(format!("{name} $A"))
                .and_then(|t| t.try_pair(format!("{name} $A {name}:1 $B:1")))
                .map_err(TokenizerError::Backend)?
                .special_tokens(vec![(name, b)])
                .build()
                .map_err(|e| TokenizerError::Backend(e.to_string()))?;
            tok.with_post_processor(Some(template));
        }
        let added = |special: bool| -> Vec<AddedToken> {
            self.specials
                .iter()
                .filter(|&&id| (self.kinds[id as usize] != Kind::UserDefined) == special)
                .map(|&id| AddedToken::from(piece(id), special).normalized(false))
                .collect()
        };
        tok.add_special_tokens(added(true)).map_err(err)?;
        tok.add_tokens(added(false)).map_err(err)?;
        Ok(tok)
    }
}
