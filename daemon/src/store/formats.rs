//! A model's formats, for `status`: each tensor counts in one format, its client's label where
//! it has one (a packed layer's raw tensors, which the daemon cannot name), else the
//! quantization the daemon holds it in, else its dtype; per format its tensors, bytes and
//! weights, whose ratio is the format's bytes per weight. A coded tensor (`coding`) counts in
//! its format with the coding's name added, at its coded bytes.
//!
//! Labels are metadata: they enter neither the model's id nor its dedup, so they cannot split
//! one host copy of the same bytes into two.

use std::collections::BTreeMap;

use super::StoredTensor;
use super::quantize::Quantization;
use super::safetensors::DType;

/// The longest label a client may give a tensor's format.
pub const MAX_LABEL_BYTES: usize = 64;

/// A client's name for the packed format a raw tensor is part of, and the weights the tensor
/// stands for (a layer's count on one of its tensors, 0 on the others).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatLabel {
    pub name: String,
    pub weights: u64,
}

/// One format of a model: how many tensors, bytes and weights it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatUse {
    pub name: String,
    pub tensors: u32,
    pub bytes: u64,
    pub weights: u64,
}

/// The formats of `tensors`, the most bytes first (ties by name).
pub fn formats(tensors: &[StoredTensor]) -> Vec<FormatUse> {
    let mut by_name: BTreeMap<String, FormatUse> = BTreeMap::new();
    for t in tensors {
        let (mut name, weights) = match (&t.label, t.quantization()) {
            (Some(label), _) => (label.name.clone(), label.weights),
            (None, Quantization::None) => (dtype_format(t.dtype), elements(&t.shape)),
            (None, q) => (q.name().to_string(), elements(&t.shape)),
        };
        // A coded tensor's bytes are its coded ones: its own format ("fp8_e4m3_block64+rans8").
        if let Some(c) = &t.coded {
            name = format!("{name}+{}", c.coding.name());
        }
        let entry = by_name.entry(name.clone()).or_insert(FormatUse {
            name,
            tensors: 0,
            bytes: 0,
            weights: 0,
        });
        entry.tensors = entry.tensors.saturating_add(1);
        entry.bytes = entry.bytes.saturating_add(t.nbytes);
        entry.weights = entry.weights.saturating_add(weights);
    }
    let mut out: Vec<FormatUse> = by_name.into_values().collect();
    out.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.name.cmp(&b.name)));
    out
}

/// A plain tensor's format: its dtype as `status` spells it ("bf16").
pub fn dtype_format(dtype: DType) -> String {
    dtype.name().to_ascii_lowercase()
}

fn elements(shape: &[u64]) -> u64 {
    shape.iter().fold(1u64, |n, &d| n.saturating_mul(d))
}

/// Whether `label` is a name the daemon gives its own formats (a dtype, a quantization or its
/// alias), in any case: a label that took one would merge with them in `status`.
pub fn is_daemon_name(label: &str) -> bool {
    let label = label.to_ascii_lowercase();
    DType::ALL.iter().any(|d| dtype_format(*d) == label)
        || quantization_names().any(|q| q == label)
        || label == "fp8"
}

/// Every quantization, by name (`none` too).
fn quantization_names() -> impl Iterator<Item = &'static str> {
    QUANTIZATIONS.into_iter().map(|q| {
        // Exhaustive, so that a new quantization cannot be left out of the list.
        use Quantization::*;
        match q {
            None | Fp8E4m3Block64 | Fp8E4m3Row | Int8Row | Fp8ScaledMusubi | Fp8ScaledComfy
            | TorchaoFloat8Rowwise | TorchaoInt8Rowwise => q.name(),
        }
    })
}

const QUANTIZATIONS: [Quantization; 8] = [
    Quantization::None,
    Quantization::Fp8E4m3Block64,
    Quantization::Fp8E4m3Row,
    Quantization::Int8Row,
    Quantization::Fp8ScaledMusubi,
    Quantization::Fp8ScaledComfy,
    Quantization::TorchaoFloat8Rowwise,
    Quantization::TorchaoInt8Rowwise,
];

/// The most bytes a manifest's `formats` takes for the formats the daemon names (a dtype or a
/// quantization each, coded or not, 64 bytes at most apiece), whatever the model.
pub const DAEMON_FORMATS_BYTES: u64 = 2 * 64 * (DType::ALL.len() + QUANTIZATIONS.len() - 1) as u64;

/// Host bytes the labels of a model's tensors take besides their entries (charged with its
/// description): each label's name and 16 for its count.
pub fn label_bytes<'a>(labels: impl IntoIterator<Item = Option<&'a FormatLabel>>) -> u64 {
    labels
        .into_iter()
        .flatten()
        .map(|l| l.name.len() as u64 + 16)
        .sum()
}

/// The most bytes the labels of a model's tensors add to its manifest: in each tensor's entry
/// its label and count ([`label_bytes`]), and an entry of `formats` per distinct label (its
/// name and 48 for its counts and framing).
pub fn label_description_bytes<'a>(
    labels: impl IntoIterator<Item = Option<&'a FormatLabel>> + Clone,
) -> u64 {
    let distinct: std::collections::BTreeSet<&str> = labels
        .clone()
        .into_iter()
        .flatten()
        .map(|l| &*l.name)
        .collect();
    let summary: u64 = distinct.iter().map(|n| n.len() as u64 + 48).sum();
    label_bytes(labels) + summary
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::QuantizedLayout;

    fn tensor(name: &str, dtype: DType, shape: &[u64], nbytes: u64) -> StoredTensor {
        StoredTensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            offset: 0,
            nbytes,
            quantized: Option::None,
            label: Option::None,
            coded: Option::None,
        }
    }

    fn labelled(t: StoredTensor, name: &str, weights: u64) -> StoredTensor {
        StoredTensor {
            label: Some(FormatLabel {
                name: name.into(),
                weights,
            }),
            ..t
        }
    }

    /// A packed layer's tensors count under their label with the weights declared once, a
    /// quantized weight under its quantization with its elements, a plain one under its dtype;
    /// the most bytes first.
    #[test]
    fn each_tensor_counts_in_one_format() {
        let fp8 = StoredTensor {
            quantized: Some(QuantizedLayout {
                quantization: Quantization::Fp8E4m3Block64,
                scale_shape: vec![64, 1],
                scale_offset: 4096,
            }),
            ..tensor("l1.weight", DType::F8E4M3, &[64, 64], 4096 + 256)
        };
        let tensors = [
            labelled(
                tensor("l0.packed", DType::U8, &[2048], 2048),
                "aitk.uint4",
                4096,
            ),
            labelled(tensor("l0.scale", DType::U8, &[128], 128), "aitk.uint4", 0),
            tensor("l0.bias", DType::BF16, &[64], 128),
            fp8,
            tensor("norm", DType::BF16, &[64], 128),
        ];
        let got = formats(&tensors);
        let want = [
            ("fp8_e4m3_block64", 1, 4352, 4096),
            ("aitk.uint4", 2, 2176, 4096),
            ("bf16", 2, 256, 128),
        ];
        let got: Vec<_> = (got.iter())
            .map(|f| (f.name.as_str(), f.tensors, f.bytes, f.weights))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_daemon_s_own_names_are_reserved_in_any_case() {
        for name in [
            "bf16",
            "BF16",
            "u8",
            "fp8_e4m3_block64",
            "fp8",
            "none",
            "int8_row",
        ] {
            assert!(is_daemon_name(name), "{name}");
        }
        for name in ["aitk.uint4", "torchao.NF4Tensor", "nf4", "bf16x"] {
            assert!(!is_daemon_name(name), "{name}");
        }
    }
}
