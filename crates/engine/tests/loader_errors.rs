//! Every way a checkpoint can be wrong is refused with an error that names the problem (and
//! the tensor), never a panic. Each test copies the small tiny-alt fixture into a temporary
//! directory, breaks one thing, and loads it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use engine::backend::cpu::CpuBackend;
use engine::generate::Engine;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-alt")
}

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// A scratch copy of the fixture: its config as JSON and its tensors as bytes.
struct Scratch {
    dir: PathBuf,
    config: Value,
    tensors: BTreeMap<String, Raw>,
}

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("lily-loader-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = fixture();
        let config: Value = serde_json::from_str(
            &std::fs::read_to_string(src.join("config.json")).expect("config"),
        )
        .expect("json");
        let bytes = std::fs::read(src.join("model.safetensors")).expect("weights");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("fixture parses");
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                (
                    n,
                    Raw {
                        dtype: v.dtype(),
                        shape: v.shape().to_vec(),
                        data: v.data().to_vec(),
                    },
                )
            })
            .collect();
        Scratch {
            dir,
            config,
            tensors,
        }
    }

    fn write(&self) {
        std::fs::write(
            self.dir.join("config.json"),
            serde_json::to_string_pretty(&self.config).expect("json"),
        )
        .expect("write config");
        let views: Vec<(String, TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(n, r)| {
                (
                    n.clone(),
                    TensorView::new(r.dtype, r.shape.clone(), &r.data).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &self.dir.join("model.safetensors"))
            .expect("write weights");
    }

    /// Writes the checkpoint and returns the load error's text.
    fn load_err(&self) -> String {
        self.write();
        load(&self.dir)
            .err()
            .unwrap_or_else(|| panic!("checkpoint in {} should not load", self.dir.display()))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn load(dir: &Path) -> Result<(), String> {
    Engine::load(dir, CpuBackend::new(1).map_err(|e| e.to_string())?)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn assert_mentions(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "error {err:?} should mention {n:?}");
    }
}

const L0: &str = "language_model.model.layers.0.";

#[test]
fn the_unmodified_copy_loads() {
    let s = Scratch::new("ok");
    s.write();
    load(&s.dir).expect("a faithful copy loads");
}

#[test]
fn vision_and_mtp_tensors_are_ignored() {
    let mut s = Scratch::new("vision");
    for name in [
        "vision_tower.blocks.0.attn.qkv.weight",
        "mtp.layers.0.input_layernorm.weight",
    ] {
        s.tensors.insert(
            name.into(),
            Raw {
                dtype: Dtype::BF16,
                shape: vec![4],
                data: vec![0; 8],
            },
        );
    }
    s.write();
    load(&s.dir).expect("vision tower and MTP weights are skipped");
}

#[test]
fn another_model_type_is_refused() {
    let mut s = Scratch::new("model-type");
    s.config["model_type"] = "qwen3_moe".into();
    assert_mentions(&s.load_err(), &["model_type", "qwen3_moe"]);
}

#[test]
fn unsupported_quantization_is_refused() {
    for (field, value, needle) in [
        ("bits", Value::from(3), "bits=3"),
        ("group_size", Value::from(32), "group_size=32"),
        ("mode", Value::from("mxfp4"), "mxfp4"),
    ] {
        let mut s = Scratch::new(&format!("quant-{field}"));
        s.config["quantization"][field] = value;
        assert_mentions(&s.load_err(), &["unsupported quantization", needle]);
    }
    let mut s = Scratch::new("quant-missing");
    let root = s.config.as_object_mut().expect("object");
    root.remove("quantization");
    root.remove("quantization_config");
    assert_mentions(&s.load_err(), &["quantization"]);
}

#[test]
fn config_errors_name_the_field() {
    let mut s = Scratch::new("cfg-missing");
    s.config["text_config"]
        .as_object_mut()
        .expect("text_config")
        .remove("num_experts");
    assert_mentions(&s.load_err(), &["num_experts", "missing"]);

    let mut s = Scratch::new("cfg-layers");
    s.config["text_config"]["num_hidden_layers"] = 7.into();
    assert_mentions(&s.load_err(), &["layer_types", "7 layers"]);

    let mut s = Scratch::new("cfg-topk");
    s.config["text_config"]["num_experts_per_tok"] = 99.into();
    assert_mentions(&s.load_err(), &["num_experts_per_tok", "99"]);

    let s = Scratch::new("cfg-json");
    s.write();
    std::fs::write(s.dir.join("config.json"), "{ not json").expect("write");
    assert_mentions(
        &load(&s.dir).expect_err("bad JSON"),
        &["config.json", "JSON"],
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let mut s = Scratch::new("missing");
    let name = format!("{L0}post_attention_layernorm.weight");
    s.tensors.remove(&name);
    assert_mentions(&s.load_err(), &[&name, "not in checkpoint"]);
}

#[test]
fn an_extra_tensor_is_named() {
    let mut s = Scratch::new("extra");
    let name = format!("{L0}mlp.unexpected.weight");
    s.tensors.insert(
        name.clone(),
        Raw {
            dtype: Dtype::BF16,
            shape: vec![2],
            data: vec![0; 4],
        },
    );
    assert_mentions(&s.load_err(), &[&name, "not consumed"]);
}

#[test]
fn a_misshaped_tensor_is_named() {
    let mut s = Scratch::new("shape");
    let name = format!("{L0}input_layernorm.weight");
    let t = s.tensors.get_mut(&name).expect("tensor");
    t.shape = vec![t.shape[0] / 2, 2];
    assert_mentions(&s.load_err(), &[&name, "shape"]);

    let mut s = Scratch::new("shape-q");
    let name = format!("{L0}mlp.shared_expert.up_proj.scales");
    let t = s.tensors.get_mut(&name).expect("tensor");
    t.shape = vec![t.shape[1], t.shape[0]];
    assert_mentions(&s.load_err(), &[&name, "shape"]);
}

#[test]
fn mistyped_tensors_are_named() {
    let mut s = Scratch::new("dtype-norm");
    let name = format!("{L0}input_layernorm.weight");
    s.tensors.get_mut(&name).expect("tensor").dtype = Dtype::F16;
    assert_mentions(&s.load_err(), &[&name, "BF16"]);

    let mut s = Scratch::new("dtype-codes");
    let name = format!("{L0}mlp.switch_mlp.up_proj.weight");
    s.tensors.get_mut(&name).expect("tensor").dtype = Dtype::I32;
    assert_mentions(&s.load_err(), &[&name, "U32"]);

    let mut s = Scratch::new("dtype-scales");
    let name = format!("{L0}mlp.switch_mlp.up_proj.biases");
    s.tensors.get_mut(&name).expect("tensor").dtype = Dtype::F16;
    assert_mentions(&s.load_err(), &[&name, "BF16"]);
}

#[test]
fn a_router_stored_at_the_wrong_bit_width_is_refused() {
    let mut s = Scratch::new("bits");
    // The config says the router is 8-bit; claim 4-bit instead: the stored codes disagree.
    s.config["quantization"]
        .as_object_mut()
        .expect("q")
        .remove(&format!("{L0}mlp.gate"));
    s.config["quantization_config"]
        .as_object_mut()
        .expect("q")
        .remove(&format!("{L0}mlp.gate"));
    assert_mentions(
        &s.load_err(),
        &[&format!("{L0}mlp.gate"), "8-bit storage", "expected 4-bit"],
    );
}

#[test]
fn an_unquantized_projection_is_refused() {
    let mut s = Scratch::new("unquantized");
    let base = format!("{L0}mlp.shared_expert.down_proj");
    s.tensors.remove(&format!("{base}.scales"));
    s.tensors.remove(&format!("{base}.biases"));
    assert_mentions(&s.load_err(), &[&base, "not an MLX quantized projection"]);
}

#[test]
fn truncated_and_corrupt_files_are_refused() {
    let s = Scratch::new("truncated");
    s.write();
    let path = s.dir.join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).expect("truncate");
    assert_mentions(
        &load(&s.dir).expect_err("truncated"),
        &["model.safetensors", "truncated"],
    );

    std::fs::write(&path, &bytes[..4]).expect("truncate");
    assert_mentions(&load(&s.dir).expect_err("stub"), &["model.safetensors"]);

    let mut garbage = bytes.clone();
    garbage[8..40].copy_from_slice(&[b'#'; 32]);
    std::fs::write(&path, &garbage).expect("corrupt");
    assert_mentions(
        &load(&s.dir).expect_err("corrupt header"),
        &["model.safetensors", "header"],
    );

    std::fs::write(&path, b"").expect("empty");
    assert_mentions(&load(&s.dir).expect_err("empty"), &["model.safetensors"]);
}

#[test]
fn missing_files_and_bad_indexes_are_refused() {
    let s = Scratch::new("nofiles");
    std::fs::write(
        s.dir.join("config.json"),
        serde_json::to_string(&s.config).expect("json"),
    )
    .expect("config");
    assert_mentions(
        &load(&s.dir).expect_err("no weights"),
        &["no model.safetensors"],
    );

    let s = Scratch::new("index");
    s.write();
    let index = serde_json::json!({"weight_map": {"language_model.lm_head.weight": "model-00002-of-00002.safetensors"}});
    std::fs::write(
        s.dir.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    assert_mentions(
        &load(&s.dir).expect_err("missing shard"),
        &["model-00002-of-00002.safetensors"],
    );

    let index =
        serde_json::json!({"weight_map": {"language_model.lm_head.weight": "../../etc/passwd"}});
    std::fs::write(
        s.dir.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("index");
    assert_mentions(&load(&s.dir).expect_err("unsafe path"), &["unsafe path"]);
}
