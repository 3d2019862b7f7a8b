//! Pre-quantized files read as they are published: musubi-tuner's `--fp8_scaled` safetensors
//! and ComfyUI's scaled-fp8 files. Both keep a linear layer's weight as `<layer>.weight`
//! (float8_e4m3fn) next to `<layer>.scale_weight`; a ComfyUI file also holds a `scaled_fp8`
//! key (any prefix). A load with quantization none of such a file stores each such weight as
//! one slice laid out as fp8_e4m3_block64's (data, zero padding to 16, little-endian fp32
//! scales, [`SCALE_ALIGN`]) with the format's [`Quantization`] and the file's scale shape; the
//! `.scale_weight` tensors are then not tensors of the model, every other tensor is kept as is.
//!
//! The rules checked (each refusal names the tensor and the rule; nothing is stored):
//! - every `.scale_weight` has its `.weight`, and that weight is F8_E4M3;
//! - scales are F32, BF16 or F16 (held as fp32: the conversion is exact) and finite;
//! - musubi (`optimize_state_dict_with_fp8` / `quantize_weight` in musubi-tuner's
//!   `modules/fp8_optimization_utils.py`): a 2-D weight [out, in] has a scale of shape [] or
//!   [1] (per tensor), [out, 1] (per channel) or [out, blocks, 1] with blocks dividing in (per
//!   block); a weight of any other rank one of shape [] or [1];
//! - ComfyUI (`scaled_fp8_ops` in `comfy/ops.py`, whose `scale_weight` is a 0-d parameter): a
//!   scale of shape [].

use super::quantize::{
    NonFinite, Quantization, QuantizeError, SCALE_ALIGN, bf16_to_f32, f16_to_f32,
};
use super::safetensors::{DType, TensorEntry};
use crate::mem::align_up;

/// The suffix of a scale's name (musubi and ComfyUI alike).
pub const SCALE_SUFFIX: &str = ".scale_weight";
/// The marker key of a ComfyUI scaled-fp8 file (after a model prefix, or alone).
pub const COMFY_MARKER: &str = "scaled_fp8";

/// Where a pre-quantized weight's parts are in its slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreLayout {
    pub quantization: Quantization,
    pub scale_shape: Vec<u64>,
    pub scale_dtype: DType,
    /// Bytes of e4m3fn data (the weight's own bytes).
    pub data_bytes: u64,
    /// The scales' offset from the slice's start: the data bytes rounded up to 16.
    pub scale_offset: u64,
    /// Data, padding and fp32 scales.
    pub nbytes: u64,
}

/// Of `entries` (every tensor of the load, in order): for each weight stored pre-quantized,
/// (index of the weight, index of its scale, its layout). Empty when the files hold no
/// `.scale_weight`. A load with a quantization other than none of such files is refused.
pub fn pair(
    entries: &[&TensorEntry],
    quantization: Quantization,
) -> Result<Vec<(usize, usize, PreLayout)>, QuantizeError> {
    let Some(first) = entries.iter().find(|e| e.name.ends_with(SCALE_SUFFIX)) else {
        return Ok(Vec::new());
    };
    let comfy = entries
        .iter()
        .any(|e| e.name == COMFY_MARKER || e.name.ends_with(&format!(".{COMFY_MARKER}")));
    let format = if comfy {
        Quantization::Fp8ScaledComfy
    } else {
        Quantization::Fp8ScaledMusubi
    };
    if quantization != Quantization::None {
        return Err(QuantizeError::Prequantized(format!(
            "tensor '{}': the file is pre-quantized ({format}): load it with quantization none",
            first.name
        )));
    }
    let index: std::collections::HashMap<&str, usize> = (entries.iter().enumerate())
        .map(|(i, e)| (e.name.as_str(), i))
        .collect();
    let mut pairs = Vec::new();
    for (si, scale) in entries.iter().enumerate() {
        let Some(layer) = scale.name.strip_suffix(SCALE_SUFFIX) else {
            continue;
        };
        let weight_name = format!("{layer}.weight");
        let Some(&wi) = index.get(weight_name.as_str()) else {
            return Err(rule(
                &scale.name,
                format!("no '{weight_name}' to scale ({format})"),
            ));
        };
        let weight = entries[wi];
        pairs.push((wi, si, layout(format, weight, scale)?));
    }
    Ok(pairs)
}

fn rule(name: &str, rule: String) -> QuantizeError {
    QuantizeError::Prequantized(format!("tensor '{name}': {rule}"))
}

/// Checks one weight and its scale against `format`'s rules; its layout.
fn layout(
    format: Quantization,
    weight: &TensorEntry,
    scale: &TensorEntry,
) -> Result<PreLayout, QuantizeError> {
    if weight.dtype != DType::F8E4M3 {
        return Err(rule(
            &weight.name,
            format!(
                "dtype {}: a weight with a .scale_weight must be F8_E4M3 (float8_e4m3fn) in {format}",
                weight.dtype
            ),
        ));
    }
    if !matches!(scale.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(rule(
            &scale.name,
            format!(
                "dtype {}: {format} scales must be F32, BF16 or F16",
                scale.dtype
            ),
        ));
    }
    let s = scale.shape.as_slice();
    let w = weight.shape.as_slice();
    let ok = match format {
        Quantization::Fp8ScaledComfy => s.is_empty(),
        _ => match (w, s) {
            (_, [] | [1]) => true,
            (&[out, _], &[o, 1]) => o == out,
            (&[out, inputs], &[o, blocks, 1]) => {
                o == out && blocks > 0 && inputs.is_multiple_of(blocks)
            }
            _ => false,
        },
    };
    if !ok {
        let needs = match (format, w.len()) {
            (Quantization::Fp8ScaledComfy, _) => "[] (one scale per weight)".to_string(),
            (_, 2) => format!(
                "[] or [1] (per tensor), [{out}, 1] (per channel) or [{out}, blocks, 1] with \
                 blocks dividing {inputs} (per block)",
                out = w[0],
                inputs = w[1]
            ),
            _ => "[] or [1] (a weight of rank other than 2 has one scale)".to_string(),
        };
        return Err(rule(
            &scale.name,
            format!(
                "shape {s:?} does not fit weight '{}' of shape {w:?}: {format} needs {needs}",
                weight.name
            ),
        ));
    }
    let count: u64 = s.iter().product();
    let scale_offset = align_up(weight.nbytes, SCALE_ALIGN);
    Ok(PreLayout {
        quantization: format,
        scale_shape: s.to_vec(),
        scale_dtype: scale.dtype,
        data_bytes: weight.nbytes,
        scale_offset,
        nbytes: scale_offset + 4 * count,
    })
}

/// Converts a scale tensor's bytes (`dtype`, little-endian) into little-endian fp32 in `out`
/// (exact: every F16 and BF16 value is an fp32 value), refusing a non-finite one.
pub fn scales_to_f32(
    name: &str,
    dtype: DType,
    bytes: &[u8],
    out: &mut [u8],
) -> Result<(), QuantizeError> {
    let values: Vec<f32> = match dtype {
        DType::F32 => (bytes.chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::BF16 => (bytes.chunks_exact(2))
            .map(|c| bf16_to_f32([c[0], c[1]]))
            .collect(),
        DType::F16 => (bytes.chunks_exact(2))
            .map(|c| f16_to_f32([c[0], c[1]]))
            .collect(),
        other => unreachable!("scale dtype {other} was refused at plan"),
    };
    for (i, (v, o)) in values.iter().zip(out.chunks_exact_mut(4)).enumerate() {
        if !v.is_finite() {
            let value = if v.is_nan() {
                NonFinite::NaN
            } else if *v > 0.0 {
                NonFinite::PosInf
            } else {
                NonFinite::NegInf
            };
            return Err(rule(
                name,
                format!("{value} at index {i}: scales must be finite"),
            ));
        }
        o.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}
