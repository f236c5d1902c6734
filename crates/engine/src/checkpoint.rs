//! Safetensors shards, memory-mapped, with MLX affine quantized tensor views and the
//! consume-all rule: every tensor must be taken by the model loader, except the vision tower
//! and MTP weights, so that a naming drift cannot silently drop weights.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::marker::PhantomData;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::bf16;
use memmap2::Mmap;
use safetensors::SafeTensors;

use crate::error::{Error, Result};

/// Tensors that mlx-community checkpoints may carry but a text-only engine does not use.
const IGNORED_PREFIXES: &[&str] = &[
    "vision_tower.",
    "model.visual.",
    "mtp.",
    "language_model.mtp.",
    "model.mtp.",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    U32,
    BF16,
    F32,
    Other,
}

#[derive(Clone)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    dtype_name: String,
    shape: Vec<usize>,
    /// Byte range inside the shard's mapping.
    start: usize,
    end: usize,
}

/// A typed slice that either points into a memory-mapped shard (no copy) or owns a copy
/// (only when the tensor is not aligned for `T` inside the file).
pub struct HostSlice<T: bytemuck::Pod> {
    repr: SliceRepr<T>,
}

enum SliceRepr<T> {
    Mapped {
        map: Arc<Mmap>,
        start: usize,
        len: usize,
        _t: PhantomData<T>,
    },
    Owned(Vec<T>),
}

impl<T: bytemuck::Pod> HostSlice<T> {
    fn new(map: &Arc<Mmap>, start: usize, end: usize) -> Self {
        let bytes = &map[start..end];
        if bytemuck::try_cast_slice::<u8, T>(bytes).is_ok() {
            let len = (end - start) / std::mem::size_of::<T>();
            HostSlice {
                repr: SliceRepr::Mapped {
                    map: map.clone(),
                    start,
                    len,
                    _t: PhantomData,
                },
            }
        } else {
            let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
            HostSlice {
                repr: SliceRepr::Owned(v),
            }
        }
    }
    pub fn from_vec(v: Vec<T>) -> Self {
        HostSlice {
            repr: SliceRepr::Owned(v),
        }
    }
}

impl<T: bytemuck::Pod> Deref for HostSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.repr {
            SliceRepr::Mapped {
                map, start, len, ..
            } => {
                // Alignment and length were checked in `new`.
                bytemuck::cast_slice(&map[*start..*start + len * std::mem::size_of::<T>()])
            }
            SliceRepr::Owned(v) => v,
        }
    }
}

/// One MLX affine quantized matrix (or a stack of expert matrices viewed as `[E*rows, cols]`):
/// `w[r][c] = scales[r][c/64] * q[r][c] + biases[r][c/64]`, codes packed low bits first in u32.
pub struct QWeight {
    pub name: String,
    pub codes: HostSlice<u32>,
    pub scales: HostSlice<bf16>,
    pub biases: HostSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group_size: usize,
}

impl QWeight {
    /// u32 words per row.
    pub fn words_per_row(&self) -> usize {
        self.cols * self.bits as usize / 32
    }
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group_size
    }
}

/// The checkpoint's tensors, memory-mapped; loaders `take` them by name.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Arc<Mmap>>,
    shard_names: Vec<String>,
    entries: BTreeMap<String, Entry>,
    consumed: HashSet<String>,
}

impl Checkpoint {
    /// Opens `model.safetensors.index.json` and its shards, or a single `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (shard_files, weight_map): (Vec<String>, Option<HashMap<String, String>>) =
            if index.exists() {
                let text = std::fs::read_to_string(&index)
                    .map_err(|e| Error::io(format!("reading {}", index.display()), e))?;
                let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                    Error::checkpoint(format!("{} is not valid JSON: {e}", index.display()))
                })?;
                let map = json
                    .get("weight_map")
                    .and_then(|m| m.as_object())
                    .ok_or_else(|| {
                        Error::checkpoint(format!("{} has no weight_map object", index.display()))
                    })?;
                let mut wm = HashMap::new();
                let mut files: Vec<String> = Vec::new();
                for (name, file) in map {
                    let file = file.as_str().ok_or_else(|| {
                        Error::checkpoint(format!("weight_map entry {name} is not a file name"))
                    })?;
                    if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                        return Err(Error::checkpoint(format!(
                            "weight_map entry {name} names an unsafe path {file:?}"
                        )));
                    }
                    if !files.iter().any(|f| f == file) {
                        files.push(file.to_string());
                    }
                    wm.insert(name.clone(), file.to_string());
                }
                files.sort();
                (files, Some(wm))
            } else if single.exists() {
                (vec!["model.safetensors".to_string()], None)
            } else {
                return Err(Error::checkpoint(format!(
                    "no model.safetensors.index.json or model.safetensors under {}",
                    dir.display()
                )));
            };

        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            shards: Vec::new(),
            shard_names: Vec::new(),
            entries: BTreeMap::new(),
            consumed: HashSet::new(),
        };
        for file in &shard_files {
            ckpt.add_shard(file)?;
        }
        if let Some(wm) = weight_map {
            for (name, file) in &wm {
                match ckpt.entries.get(name) {
                    None => {
                        return Err(Error::checkpoint(format!(
                            "tensor {name} is listed in the index under {file} but that shard does not contain it"
                        )));
                    }
                    Some(e) if &ckpt.shard_names[e.shard] != file => {
                        return Err(Error::checkpoint(format!(
                            "tensor {name} is listed in the index under {file} but found in {}",
                            ckpt.shard_names[e.shard]
                        )));
                    }
                    _ => {}
                }
            }
            if let Some(extra) = ckpt.entries.keys().find(|n| !wm.contains_key(*n)) {
                return Err(Error::checkpoint(format!(
                    "tensor {extra} is in a shard but not in the index"
                )));
            }
        }
        Ok(ckpt)
    }

    fn add_shard(&mut self, file: &str) -> Result<()> {
        let path = self.dir.join(file);
        let f = File::open(&path)
            .map_err(|e| Error::io(format!("opening shard {}", path.display()), e))?;
        // SAFETY: the mapping is read-only; like every mmap-based loader we rely on the checkpoint
        // not being modified while the server runs.
        let map = unsafe { Mmap::map(&f) }
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        let (header_len, _) = SafeTensors::read_metadata(&map[..]).map_err(|e| {
            Error::checkpoint(format!(
                "{file}: corrupt safetensors header or truncated file: {e}"
            ))
        })?;
        let tensors = SafeTensors::deserialize(&map[..]).map_err(|e| {
            Error::checkpoint(format!(
                "{file}: corrupt or truncated safetensors file: {e}"
            ))
        })?;
        let data_start = 8 + header_len;
        let base = map.as_ptr() as usize;
        let shard = self.shards.len();
        for (name, view) in tensors.tensors() {
            if self.entries.contains_key(&name) {
                return Err(Error::checkpoint(format!(
                    "tensor {name} appears in multiple shards"
                )));
            }
            let start = view.data().as_ptr() as usize - base;
            let end = start + view.data().len();
            debug_assert!(start >= data_start);
            let dtype_name = format!("{:?}", view.dtype());
            let dtype = match view.dtype() {
                safetensors::Dtype::U32 => Dtype::U32,
                safetensors::Dtype::BF16 => Dtype::BF16,
                safetensors::Dtype::F32 => Dtype::F32,
                _ => Dtype::Other,
            };
            self.entries.insert(
                name,
                Entry {
                    shard,
                    dtype,
                    dtype_name,
                    shape: view.shape().to_vec(),
                    start,
                    end,
                },
            );
        }
        drop(tensors);
        self.shards.push(Arc::new(map));
        self.shard_names.push(file.to_string());
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Shape and dtype of a tensor without consuming it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    fn take_entry(&mut self, name: &str) -> Result<Entry> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| Error::checkpoint(format!("tensor {name} not in checkpoint")))?;
        self.consumed.insert(name.to_string());
        Ok(e.clone())
    }

    fn slice<T: bytemuck::Pod>(&self, e: &Entry) -> HostSlice<T> {
        HostSlice::new(&self.shards[e.shard], e.start, e.end)
    }

    /// A BF16 tensor of exactly `shape`, widened to f32.
    pub fn take_bf16(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.take_entry(name)?;
        check_shape(name, &e.shape, shape)?;
        if e.dtype != Dtype::BF16 {
            return Err(Error::checkpoint(format!(
                "{name} must be BF16, found {}",
                e.dtype_name
            )));
        }
        let s: HostSlice<bf16> = self.slice(&e);
        Ok(s.iter().map(|v| v.to_f32()).collect())
    }

    /// An F32 (or BF16) tensor of exactly `shape`, as f32.
    pub fn take_f32_or_bf16(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.take_entry(name)?;
        check_shape(name, &e.shape, shape)?;
        match e.dtype {
            Dtype::F32 => Ok(self.slice::<f32>(&e).to_vec()),
            Dtype::BF16 => Ok(self.slice::<bf16>(&e).iter().map(|v| v.to_f32()).collect()),
            _ => Err(Error::checkpoint(format!(
                "{name} must be F32 or BF16, found {}",
                e.dtype_name
            ))),
        }
    }

    /// The MLX quantized projection `base` (`base.weight` U32 codes, `base.scales`/`base.biases`
    /// BF16) with logical shape `lead ++ [out, inp]`, stored with `bits` per weight.
    /// Leading dims (an expert stack) are folded into rows.
    pub fn take_quantized(
        &mut self,
        base: &str,
        lead: &[usize],
        out: usize,
        inp: usize,
        bits: u32,
        group: usize,
    ) -> Result<QWeight> {
        let wname = format!("{base}.weight");
        let sname = format!("{base}.scales");
        let bname = format!("{base}.biases");
        if !self.contains(&sname) || !self.contains(&bname) {
            if self.contains(&wname) {
                return Err(Error::checkpoint(format!(
                    "{base} is not an MLX quantized projection (no .scales/.biases)"
                )));
            }
            return Err(Error::checkpoint(format!(
                "tensor {wname} not in checkpoint"
            )));
        }
        if !inp.is_multiple_of(group) || !(inp * bits as usize).is_multiple_of(32) {
            return Err(Error::checkpoint(format!(
                "in_features {inp} of {base} is not divisible by group size {group}"
            )));
        }
        let rows: usize = lead.iter().product::<usize>() * out;
        let mut wshape = lead.to_vec();
        wshape.extend([out, inp * bits as usize / 32]);
        let mut sshape = lead.to_vec();
        sshape.extend([out, inp / group]);

        let we = self.take_entry(&wname)?;
        if we.dtype != Dtype::U32 {
            return Err(Error::checkpoint(format!(
                "{wname}: quantized codes must be U32, found {}",
                we.dtype_name
            )));
        }
        if we.shape != wshape {
            // Say which bit width the stored shape implies, the usual cause of a mismatch.
            if we.shape.len() == wshape.len()
                && we.shape[..wshape.len() - 1] == wshape[..wshape.len() - 1]
            {
                let cols = we.shape[wshape.len() - 1];
                if (32 * cols) % inp == 0 && [2, 3, 4, 5, 6, 8].contains(&(32 * cols / inp)) {
                    return Err(Error::checkpoint(format!(
                        "{base} uses {}-bit storage; expected {bits}-bit for this projection",
                        32 * cols / inp
                    )));
                }
            }
            return Err(Error::checkpoint(format!(
                "{wname} shape {:?} != expected {wshape:?}",
                we.shape
            )));
        }
        let codes = self.slice::<u32>(&we);
        let mut take_sb = |name: &str| -> Result<HostSlice<bf16>> {
            let e = self.take_entry(name)?;
            if e.dtype != Dtype::BF16 {
                return Err(Error::checkpoint(format!(
                    "{name}: quantized scales/biases must be BF16, found {}",
                    e.dtype_name
                )));
            }
            if e.shape != sshape {
                return Err(Error::checkpoint(format!(
                    "{name} shape {:?} != expected {sshape:?}",
                    e.shape
                )));
            }
            Ok(HostSlice::new(&self.shards[e.shard], e.start, e.end))
        };
        let scales = take_sb(&sname)?;
        let biases = take_sb(&bname)?;
        Ok(QWeight {
            name: base.to_string(),
            codes,
            scales,
            biases,
            rows,
            cols: inp,
            bits,
            group_size: group,
        })
    }

    /// Fails if any tensor (other than the ignored vision/MTP ones) was never taken.
    pub fn finish(&self) -> Result<()> {
        let left: Vec<&String> = self
            .entries
            .keys()
            .filter(|n| {
                !self.consumed.contains(*n) && !IGNORED_PREFIXES.iter().any(|p| n.starts_with(p))
            })
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        let shown: Vec<&str> = left.iter().take(8).map(|s| s.as_str()).collect();
        Err(Error::checkpoint(format!(
            "{} checkpoint tensors were not consumed (unexpected names?): {}{}",
            left.len(),
            shown.join(", "),
            if left.len() > 8 { ", ..." } else { "" }
        )))
    }

    /// Total bytes of all mapped shards.
    pub fn mapped_bytes(&self) -> usize {
        self.shards.iter().map(|m| m.len()).sum()
    }
}

fn check_shape(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        return Err(Error::checkpoint(format!(
            "{name} shape {got:?} != expected {want:?}"
        )));
    }
    Ok(())
}
