//! `lily synth` checkpoints: the engine loads them and runs a finite forward pass; a seed
//! reproduces the same bytes (whatever the thread count) and a different seed does not; forced
//! small shards load to identical logits.

use std::path::{Path, PathBuf};

use engine::backend::Backend;
use engine::backend::cpu::CpuBackend;
use engine::generate::Engine;
use engine::synth::{SynthSpec, WriteOptions, write_checkpoint, write_checkpoint_with};

/// A unique directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        TempDir(std::env::temp_dir().join(format!(
            "lily-synth-test-{tag}-{}-{nanos}",
            std::process::id()
        )))
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn odd_spec() -> SynthSpec {
    SynthSpec {
        hidden: 192,
        layers: 5,
        full_attention_interval: 2,
        vocab: 3000,
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
        linear_key_heads: 2,
        linear_value_heads: 6,
        experts: 12,
        top_k: 3,
        moe_inter: 128,
        shared_inter: 64,
        seed: 11,
        ..SynthSpec::preset("tiny").unwrap()
    }
}

/// Loads `dir`, prefills a few ids and decodes 3 greedy steps; returns every logits row.
fn run(dir: &Path) -> Vec<Vec<f32>> {
    let eng = Engine::load(dir, CpuBackend::new(2).unwrap()).unwrap();
    let mut state = eng.new_state(32).unwrap();
    let mut rows = Vec::new();
    let mut logits = eng.prefill(&[1, 17, 42, 7, 2999], &mut state).unwrap();
    for _ in 0..3 {
        rows.push(eng.backend.download(&logits).unwrap());
        let next = eng.argmax(&logits).unwrap();
        logits = eng.decode_step(next, &mut state).unwrap();
    }
    rows.push(eng.backend.download(&logits).unwrap());
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r.len(), eng.config().vocab_size);
        assert!(
            r.iter().all(|v| v.is_finite()),
            "{}: non-finite logits at step {i}",
            dir.display()
        );
        let (lo, hi) = r
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        assert!(
            hi - lo > 0.1,
            "{}: degenerate logits at step {i} ({lo}..{hi})",
            dir.display()
        );
    }
    rows
}

/// Every safetensors file of a checkpoint, by name.
fn shards(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn tokenizer_dir() -> Option<PathBuf> {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-qwen3_5_moe");
    d.join("tokenizer.json").is_file().then_some(d)
}

#[test]
fn tiny_preset_loads_runs_and_is_deterministic() {
    let spec = SynthSpec {
        seed: 1,
        ..SynthSpec::preset("tiny").unwrap()
    };
    let a = TempDir::new("tiny-a");
    let tok = tokenizer_dir();
    let r = write_checkpoint(&spec, a.path(), tok.as_deref(), 2).unwrap();
    assert_eq!(r.shards, 1);
    assert!(a.path().join("model.safetensors").is_file());
    assert!(a.path().join("model.safetensors.index.json").is_file());
    assert!(a.path().join("generation_config.json").is_file());
    if tok.is_some() {
        assert!(a.path().join("tokenizer.json").is_file());
        assert!(a.path().join("chat_template.jinja").is_file());
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization"], cfg["quantization_config"]);
    assert_eq!(
        cfg["quantization"]["language_model.model.layers.7.mlp.gate"]["bits"],
        8
    );
    // Same tensor set, names, dtypes and shapes as the real mlx-lm conversion of this shape.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-qwen3_5_moe/model.safetensors");
    if fixture.is_file() {
        let ours = std::fs::read(a.path().join("model.safetensors")).unwrap();
        let theirs = std::fs::read(&fixture).unwrap();
        let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
        let theirs = safetensors::SafeTensors::deserialize(&theirs).unwrap();
        let desc = |t: &safetensors::SafeTensors| {
            let mut v: Vec<(String, String, Vec<usize>)> = t
                .tensors()
                .into_iter()
                .map(|(n, v)| (n, format!("{:?}", v.dtype()), v.shape().to_vec()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(desc(&ours), desc(&theirs));
    }
    run(a.path());

    // Same seed, other thread count: byte-identical shards.
    let b = TempDir::new("tiny-b");
    write_checkpoint(&spec, b.path(), None, 1).unwrap();
    assert!(
        shards(a.path()) == shards(b.path()),
        "same seed gave different bytes"
    );

    // Another seed: different bytes.
    let c = TempDir::new("tiny-c");
    write_checkpoint(
        &SynthSpec {
            seed: 2,
            ..spec.clone()
        },
        c.path(),
        None,
        2,
    )
    .unwrap();
    assert!(
        shards(a.path()) != shards(c.path()),
        "different seeds gave the same bytes"
    );
}

#[test]
fn odd_shape_loads_and_small_shards_load_identically() {
    let spec = odd_spec();
    let one = TempDir::new("odd-one");
    let r = write_checkpoint(&spec, one.path(), None, 2).unwrap();
    assert_eq!(r.shards, 1);
    let logits = run(one.path());

    let many = TempDir::new("odd-many");
    let small = SynthSpec {
        max_shard_bytes: 512 << 10,
        ..spec.clone()
    };
    let r = write_checkpoint(&small, many.path(), None, 3).unwrap();
    assert!(r.shards > 3, "expected several shards, got {}", r.shards);
    let files = shards(many.path());
    assert_eq!(files.len(), r.shards);
    assert_eq!(
        files[0].0,
        format!("model-00001-of-{:05}.safetensors", r.shards)
    );
    assert!(!many.path().join("model.safetensors").exists());
    assert_eq!(run(many.path()), logits, "sharding changed the model");

    // Same seed again: identical bytes; another seed: different.
    let again = TempDir::new("odd-again");
    write_checkpoint(&spec, again.path(), None, 1).unwrap();
    assert!(shards(one.path()) == shards(again.path()));
    let other = TempDir::new("odd-other");
    write_checkpoint(&SynthSpec { seed: 12, ..spec }, other.path(), None, 2).unwrap();
    assert!(shards(one.path()) != shards(other.path()));
}

#[test]
fn refuses_non_empty_dir_without_force() {
    let spec = SynthSpec {
        vocab: 512,
        layers: 2,
        experts: 8,
        top_k: 2,
        ..SynthSpec::preset("tiny").unwrap()
    };
    let d = TempDir::new("force");
    std::fs::create_dir_all(d.path()).unwrap();
    std::fs::write(d.path().join("keep.txt"), b"x").unwrap();
    let err = write_checkpoint(&spec, d.path(), None, 1).unwrap_err();
    assert!(err.to_string().contains("--force"), "{err}");
    assert!(d.path().join("keep.txt").exists());
    write_checkpoint_with(
        &spec,
        d.path(),
        &WriteOptions {
            force: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!d.path().join("keep.txt").exists());
    assert!(d.path().join("model.safetensors").is_file());
    // No temporary directories are left next to the output.
    let parent = d.path().parent().unwrap();
    let name = d.path().file_name().unwrap().to_string_lossy().into_owned();
    let leftovers = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{name}.synth-"))
        })
        .count();
    assert_eq!(leftovers, 0);
    // An empty existing directory is fine without force.
    let e = TempDir::new("empty");
    std::fs::create_dir_all(e.path()).unwrap();
    write_checkpoint(&spec, e.path(), None, 1).unwrap();
}
