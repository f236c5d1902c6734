//! Tokenizer goldens (HF `tokenizers` behaviour), stop ids, streaming decode, errors.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use engine::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Root of the test fixtures (tokenizer/, tiny-qwen3_5_moe/).
fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn model_dir() -> PathBuf {
    fixtures().join("tiny-qwen3_5_moe")
}

/// tokenizer.json is 15 MB: parse it once per test binary.
fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let t0 = Instant::now();
        let tok = Tokenizer::from_dir(&model_dir()).expect("load fixture tokenizer");
        eprintln!("tokenizer loaded in {:?}", t0.elapsed());
        tok
    })
}

fn nfc(s: &str) -> String {
    let mut n = tokenizers::NormalizedString::from(s);
    n.nfc();
    n.get().to_owned()
}

fn special_tokens() -> Vec<(String, u32)> {
    let mut v: Vec<(String, u32)> = tok()
        .inner()
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| (t.content, id))
        .collect();
    v.sort_by_key(|(_, id)| *id);
    v
}

/// HF's algorithm spelled out: split on added tokens first (leftmost, longest), then
/// normalize and encode each remaining piece on its own.
fn hf_reference_ids(text: &str) -> Vec<u32> {
    let specials = special_tokens();
    let mut ids = Vec::new();
    let mut rest = text;
    loop {
        let hit = specials
            .iter()
            .filter_map(|(s, id)| rest.find(s.as_str()).map(|pos| (pos, s.len(), *id)))
            .min_by_key(|(pos, len, _)| (*pos, usize::MAX - len));
        let Some((pos, len, id)) = hit else { break };
        ids.extend(tok().encode(&rest[..pos]).unwrap());
        ids.push(id);
        rest = &rest[pos + len..];
    }
    ids.extend(tok().encode(rest).unwrap());
    ids
}

#[test]
fn fixture_stop_ids_and_vocab() {
    let t = tok();
    assert_eq!(t.stop_ids(), &[248046, 248044]); // <|im_end|> first
    assert!(t.is_stop(248044) && !t.is_stop(198));
    assert_eq!(t.vocab_size(), 248_077); // 248,044 ranks + 33 added tokens
    assert_eq!(t.token_to_id("<|im_end|>"), Some(248046));
    assert_eq!(t.token_to_id("<think>"), Some(248068));
    assert_eq!(t.id_to_token(248045).as_deref(), Some("<|im_start|>"));
    assert_eq!(t.id_to_token(248_077), None);
}

#[test]
fn encode_recognises_special_tokens_without_adding_any() {
    let t = tok();
    assert_eq!(t.encode("").unwrap(), Vec::<u32>::new());
    assert_eq!(t.encode("<|im_start|>user\n").unwrap(), [248045, 846, 198]);
    let ids = t.encode("<|im_start|>user\nHi<|im_end|>").unwrap();
    assert_eq!(
        t.decode(&ids, false).unwrap(),
        "<|im_start|>user\nHi<|im_end|>"
    );
    assert_eq!(t.decode(&ids, true).unwrap(), "user\nHi");
    // <think> is an added but non-special token: skip_special keeps it.
    assert_eq!(
        t.decode(&[248068, 198, 248069], true).unwrap(),
        "<think>\n</think>"
    );
}

#[test]
fn jsonl_cases_match_hf_ids_and_round_trip() {
    let path = fixtures().join("tokenizer/tokenizer_cases.jsonl");
    let text = fs::read_to_string(&path).unwrap();
    let specials = special_tokens();
    let t0 = Instant::now();
    let (mut cases, mut tokens, mut divergent) = (0usize, 0usize, 0usize);
    for (line_no, line) in text.lines().enumerate() {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        let s = case["text"].as_str().unwrap();
        let stored: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let ids = tok().encode(s).unwrap();
        cases += 1;
        tokens += ids.len();
        // The jsonl holds tiktoken ids. They differ from HF only where NFC glues a special
        // token's '>' to a following U+0338 (golden.md §5); HF (= the real tokenizer.json)
        // is expected there, so such a case is checked against HF's algorithm instead.
        let glued = nfc(s);
        if specials
            .iter()
            .any(|(sp, _)| s.contains(sp.as_str()) && !glued.contains(sp.as_str()))
        {
            divergent += 1;
            assert_eq!(ids, hf_reference_ids(s), "line {}: {s:?}", line_no + 1);
            continue;
        }
        assert_eq!(ids, stored, "line {}: {s:?}", line_no + 1);
        assert_eq!(
            tok().decode(&ids, false).unwrap(),
            glued,
            "line {}",
            line_no + 1
        );
    }
    eprintln!(
        "{cases} cases, {tokens} tokens, {divergent} NFC/special divergent, {:?}",
        t0.elapsed()
    );
    // This file is verify_tokenizer.py's default run (671 strings) minus its 2 divergent
    // strings, which the script leaves out rather than storing; see the next test.
    assert_eq!((cases, divergent), (669, 0));
}

#[test]
fn nfc_special_token_divergence_follows_hf() {
    // tiktoken's wrapper normalizes first: '>' + U+0338 becomes U+226F and the special
    // token disappears. HF matches added tokens first: <|im_end|> survives.
    let t = tok();
    let s = "<|im_end|>\u{338}";
    let ids = t.encode(s).unwrap();
    assert_eq!(ids[0], 248046);
    assert_eq!(ids[1..], t.encode("\u{338}").unwrap()[..]);
    assert_ne!(ids, t.encode(&nfc(s)).unwrap());
    assert_eq!(t.decode(&ids, false).unwrap(), s); // not NFC(s)
    let s2 = "a<think>\u{338}b<|endoftext|>\u{338}";
    assert_eq!(t.encode(s2).unwrap(), hf_reference_ids(s2));
}

/// GPT-2 byte-to-unicode map: the token of each single byte.
fn byte_token_ids() -> Vec<u32> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            let ch = char::from_u32(c).unwrap().to_string();
            tok().token_to_id(&ch).unwrap()
        })
        .collect()
}

fn stream_all(ids: &[u32]) -> (String, Vec<String>, usize) {
    let mut dec = tok().stream_decoder();
    let mut chunks = Vec::new();
    let mut max_window = 0;
    for &id in ids {
        chunks.push(dec.push(id).unwrap());
        max_window = max_window.max(dec.window_len());
    }
    chunks.push(dec.finish().unwrap());
    (chunks.concat(), chunks, max_window)
}

#[test]
fn stream_matches_decode_on_random_ids() {
    let t = tok();
    let bytes = byte_token_ids();
    let mut rng = StdRng::seed_from_u64(0x11_1e);
    let t0 = Instant::now();
    let mut total = 0;
    for round in 0..300 {
        let len = rng.random_range(0..60);
        let ids: Vec<u32> = (0..len)
            .map(|_| match round % 3 {
                // Whole vocabulary, specials included (some are skipped).
                0 => rng.random_range(0..t.vocab_size() as u32),
                // Raw bytes: mostly broken UTF-8.
                1 => bytes[rng.random_range(0..256)],
                // Bytes mixed with special and ordinary tokens.
                _ => match rng.random_range(0..4) {
                    0 => rng.random_range(248_044..248_077),
                    1 => rng.random_range(0..248_044),
                    _ => bytes[rng.random_range(0x80..256)],
                },
            })
            .collect();
        total += ids.len();
        let (streamed, _, _) = stream_all(&ids);
        assert_eq!(
            streamed,
            t.decode(&ids, true).unwrap(),
            "round {round}: {ids:?}"
        );
    }
    eprintln!("random stream: {total} ids in {:?}", t0.elapsed());
}

#[test]
fn stream_multibyte_text_token_by_token() {
    let texts = [
        "中文测试：你好，世界！这是一个句子。",
        "日本語のテキストです。한국어 문장입니다.",
        "😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇺🇸🇯🇵 🤖🤖🤖",
        "नमस्ते दुनिया, हिन्दी। สวัสดีชาวโลก שָׁלוֹם",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n答案是 42 🎉<|im_end|>",
    ];
    for text in texts {
        let ids = tok().encode(text).unwrap();
        let mut keep = StreamDecoder::new(tok(), false);
        let mut kept: String = ids.iter().map(|&id| keep.push(id).unwrap()).collect();
        kept.push_str(&keep.finish().unwrap());
        assert_eq!(kept, text); // special tokens kept; these texts are already NFC
        let (streamed, chunks, max_window) = stream_all(&ids);
        assert_eq!(streamed, tok().decode(&ids, true).unwrap());
        for c in &chunks {
            assert!(!c.contains('\u{FFFD}'), "split character in {chunks:?}");
        }
        // Valid text is fully emitted by the last push: finish has nothing left.
        assert_eq!(chunks.last().map(String::as_str), Some(""));
        assert!(max_window <= 5, "window grew to {max_window}");
    }
}

#[test]
fn stream_window_stays_bounded_on_replacement_char_runs() {
    let t = tok();
    let mut ids = t.encode(&"\u{FFFD}".repeat(300)).unwrap();
    ids.extend(byte_token_ids()[0xE4..0xE5].iter().copied()); // dangling lead byte
    ids.extend(t.encode("ok").unwrap());
    let (streamed, _, max_window) = stream_all(&ids);
    assert_eq!(streamed, t.decode(&ids, true).unwrap());
    assert!(max_window <= 9, "window grew to {max_window}");
}

#[test]
fn stream_is_linear_and_reusable_after_finish() {
    let t = tok();
    let text = "The quick brown fox 跳过了 the lazy dog 🐕. ".repeat(1000);
    let ids = t.encode(&text).unwrap();
    let mut dec = StreamDecoder::new(t, true);
    let t0 = Instant::now();
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&dec.push(id).unwrap());
    }
    out.push_str(&dec.finish().unwrap());
    let elapsed = t0.elapsed();
    eprintln!("streamed {} ids in {elapsed:?}", ids.len());
    assert_eq!(out, text);
    assert_eq!(dec.window_len(), 0);
    assert_eq!(
        dec.push(ids[0]).unwrap(),
        t.decode(&ids[..1], true).unwrap()
    );
}

/// A fresh directory under the system temp dir (removed by the caller).
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lily-tok-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

const TINY_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
 "added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,
 "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"<eos>":1,"b":2},"unk_token":"a"}}"#;

fn load_with(name: &str, files: &[(&str, &str)]) -> Result<Tokenizer, TokenizerError> {
    let dir = temp_dir(name);
    fs::write(dir.join("tokenizer.json"), TINY_TOKENIZER).unwrap();
    for (file, body) in files {
        fs::write(dir.join(file), body).unwrap();
    }
    let result = Tokenizer::from_dir(&dir);
    let _ = fs::remove_dir_all(&dir);
    result
}

fn assert_err(result: Result<Tokenizer, TokenizerError>, needles: &[&str]) {
    let msg = result.expect_err("expected an error").to_string();
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
}

#[test]
fn stop_ids_from_all_sources_in_order() {
    let tok = load_with(
        "order",
        &[
            (
                "tokenizer_config.json",
                r#"{"eos_token": {"content": "<eos>"}}"#,
            ),
            ("generation_config.json", r#"{"eos_token_id": 2}"#),
            (
                "config.json",
                r#"{"eos_token_id": [1, 2], "text_config": {"eos_token_id": 0}}"#,
            ),
        ],
    )
    .unwrap();
    assert_eq!(tok.stop_ids(), &[1, 2, 0]);
    assert_eq!(load_with("none", &[]).unwrap().stop_ids(), &[] as &[u32]);
}

#[test]
fn errors_name_the_file_and_problem() {
    let missing = Path::new("/nonexistent/lily-model");
    let err = Tokenizer::from_dir(missing).unwrap_err();
    assert!(matches!(err, TokenizerError::MissingFile { .. }));
    assert!(
        err.to_string()
            .contains("/nonexistent/lily-model/tokenizer.json"),
        "{err}"
    );

    let dir = temp_dir("badtok");
    fs::write(dir.join("tokenizer.json"), "{").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    let _ = fs::remove_dir_all(&dir);
    assert!(matches!(err, TokenizerError::Load { .. }));
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let cfg = "tokenizer_config.json";
    assert_err(load_with("json", &[(cfg, "{,")]), &[cfg, "invalid JSON"]);
    let unknown = r#"{"eos_token": "<|nope|>"}"#;
    assert_err(
        load_with("vocab", &[(cfg, unknown)]),
        &[cfg, "<|nope|>", "not in the vocabulary"],
    );
    assert_err(
        load_with("type", &[(cfg, r#"{"eos_token": 5}"#)]),
        &[cfg, "eos_token"],
    );
    let gen_cfg = "generation_config.json";
    let bad_id = r#"{"eos_token_id": ["x"]}"#;
    assert_err(
        load_with("id", &[(gen_cfg, bad_id)]),
        &[gen_cfg, "eos_token_id", "\"x\""],
    );
    let big = r#"{"text_config": {"eos_token_id": 3}}"#;
    assert_err(
        load_with("range", &[("config.json", big)]),
        &["config.json", "text_config.eos_token_id 3", "outside"],
    );
}
