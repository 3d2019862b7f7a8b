//! Pre-quantized files read as they are published: musubi-tuner's `--fp8_scaled` safetensors
//! and ComfyUI's scaled-fp8 files, legacy and "mixed precision". The first two keep a linear
//! layer's weight as `<layer>.weight` (float8_e4m3fn) next to `<layer>.scale_weight`; a legacy
//! ComfyUI file also holds a `scaled_fp8` key (any prefix). A ComfyUI mixed-precision file
//! (`comfy/quant_ops.py`'s `float8_e4m3fn` layout, `TensorCoreFP8Layout`) marks each quantized
//! layer with a `<layer>.comfy_quant` tensor (its config as UTF-8 JSON in U8) or lists it in the
//! header's `_quantization_metadata`, and keeps its scale as `<layer>.weight_scale`; it
//! dequantizes as the legacy one does (`q.to(D) * scale`, the fp32 scale rounded to D first),
//! so it is read as `fp8_scaled_comfy` too. A load with quantization none of such a file stores
//! each such weight as one slice laid out as fp8_e4m3_block64's (data, zero padding to 16,
//! little-endian fp32 scales, [`SCALE_ALIGN`]) with the format's [`Quantization`] and the file's
//! scale shape; the scale tensors are then not tensors of the model, every other tensor (the
//! markers and input scales included) is kept as is.
//!
//! The rules checked (each refusal names the tensor and the rule; nothing is stored):
//! - every `.scale_weight` has its `.weight`, and that weight is F8_E4M3;
//! - scales are F32, BF16 or F16 (held as fp32: the conversion is exact) and finite;
//! - musubi (`optimize_state_dict_with_fp8` / `quantize_weight` in musubi-tuner's
//!   `modules/fp8_optimization_utils.py`): a 2-D weight [out, in] has a scale of shape [] or
//!   [1] (per tensor), [out, 1] (per channel) or [out, blocks, 1] with blocks dividing in (per
//!   block); a weight of any other rank one of shape [] or [1];
//! - ComfyUI legacy (`scaled_fp8_ops` in `comfy/ops.py`, whose `scale_weight` is a 0-d
//!   parameter): a scale of shape [];
//! - ComfyUI mixed precision: a marked layer has its `.weight` (F8_E4M3: the other layouts,
//!   nvfp4, mxfp8 and int8, are not read) and a `.weight_scale` of shape [] or [1] (one scale
//!   per tensor); a `.comfy_quant` marker is U8 of rank 1; `_quantization_metadata` is JSON
//!   whose `layers` each name the format `float8_e4m3fn`.
//!
//! torchao's weights are not read from files: a client uploads them as torchao holds them
//! (`qdata` and `scale` of a `Float8Tensor` or `Int8Tensor` quantized per row) in the same slice
//! layout, and [`torchao_layout`] checks each declaration against its format's rules.

use super::quantize::{
    NonFinite, Quantization, QuantizeError, SCALE_ALIGN, bf16_to_f32, f16_to_f32,
};
use super::safetensors::{DType, TensorEntry};
use crate::mem::align_up;

/// The suffix of a scale's name (musubi and legacy ComfyUI alike).
pub const SCALE_SUFFIX: &str = ".scale_weight";
/// The marker key of a legacy ComfyUI scaled-fp8 file (after a model prefix, or alone).
pub const COMFY_MARKER: &str = "scaled_fp8";
/// The suffix of a scale's name in a ComfyUI mixed-precision file.
pub const WEIGHT_SCALE_SUFFIX: &str = ".weight_scale";
/// The suffix of a layer's marker in a ComfyUI mixed-precision file.
pub const COMFY_QUANT_SUFFIX: &str = ".comfy_quant";
/// The header metadata key that lists a ComfyUI mixed-precision file's quantized layers.
pub const COMFY_QUANT_METADATA: &str = "_quantization_metadata";
/// The one ComfyUI mixed-precision layout read (`QUANT_ALGOS` in `comfy/quant_ops.py`).
pub const COMFY_FP8_FORMAT: &str = "float8_e4m3fn";

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

/// The layers a file's header lists in `_quantization_metadata` (ComfyUI mixed precision),
/// refusing a listing that is not JSON or names a format other than `float8_e4m3fn`.
pub fn listed_layers(
    path: &str,
    metadata: &std::collections::BTreeMap<String, String>,
) -> Result<Vec<String>, QuantizeError> {
    #[derive(serde::Deserialize)]
    struct Listing {
        #[serde(default)]
        layers: std::collections::BTreeMap<String, Layer>,
    }
    #[derive(serde::Deserialize)]
    struct Layer {
        format: String,
    }
    let Some(text) = metadata.get(COMFY_QUANT_METADATA) else {
        return Ok(Vec::new());
    };
    let listing: Listing = serde_json::from_str(text).map_err(|e| {
        QuantizeError::Prequantized(format!(
            "{path}: header metadata '{COMFY_QUANT_METADATA}' is not a ComfyUI layer listing \
             ({{\"layers\": {{name: {{\"format\": ...}}}}}}): {e}"
        ))
    })?;
    let mut layers = Vec::new();
    for (layer, config) in listing.layers {
        if config.format != COMFY_FP8_FORMAT {
            return Err(QuantizeError::Prequantized(format!(
                "{path}: layer '{layer}' is '{}' in '{COMFY_QUANT_METADATA}': of ComfyUI's \
                 mixed-precision layouts only {COMFY_FP8_FORMAT} (one fp32 scale per weight) \
                 is read",
                config.format
            )));
        }
        layers.push(layer);
    }
    Ok(layers)
}

/// Of `entries` (every tensor of the load, in order) and the layers the headers list
/// ([`listed_layers`]): for each weight stored pre-quantized, (index of the weight, index of
/// its scale, its layout). Empty when the files hold no scales of either kind. A load with a
/// quantization other than none of such files is refused.
pub fn pair(
    entries: &[&TensorEntry],
    listed: &[String],
    quantization: Quantization,
) -> Result<Vec<(usize, usize, PreLayout)>, QuantizeError> {
    let index: std::collections::HashMap<&str, usize> = (entries.iter().enumerate())
        .map(|(i, e)| (e.name.as_str(), i))
        .collect();
    // ComfyUI mixed precision: each marked or listed layer, once, in the order found.
    let mut mixed: Vec<&str> = Vec::new();
    for e in entries {
        if let Some(layer) = e.name.strip_suffix(COMFY_QUANT_SUFFIX) {
            if e.dtype != DType::U8 || e.shape.len() != 1 {
                return Err(rule(
                    &e.name,
                    format!(
                        "dtype {} shape {:?}: a ComfyUI layer marker is U8 of rank 1 (its \
                         config as JSON)",
                        e.dtype, e.shape
                    ),
                ));
            }
            mixed.push(layer);
        }
    }
    for layer in listed {
        if !mixed.contains(&layer.as_str()) {
            mixed.push(layer);
        }
    }
    let legacy = entries.iter().find(|e| e.name.ends_with(SCALE_SUFFIX));
    let first = match (legacy, mixed.first()) {
        (Some(scale), _) => scale.name.clone(),
        (None, Some(layer)) => format!("{layer}{COMFY_QUANT_SUFFIX}"),
        (None, None) => return Ok(Vec::new()),
    };
    let comfy = !mixed.is_empty()
        || entries
            .iter()
            .any(|e| e.name == COMFY_MARKER || e.name.ends_with(&format!(".{COMFY_MARKER}")));
    let format = if comfy {
        Quantization::Fp8ScaledComfy
    } else {
        Quantization::Fp8ScaledMusubi
    };
    if quantization != Quantization::None {
        return Err(QuantizeError::Prequantized(format!(
            "tensor '{first}': the file is pre-quantized ({format}): load it with quantization none"
        )));
    }
    let mut pairs: Vec<(usize, usize, PreLayout)> = Vec::new();
    let mut scales: Vec<(&str, String, Kind)> = (entries.iter())
        .filter_map(|e| e.name.strip_suffix(SCALE_SUFFIX))
        .map(|layer| (layer, format!("{layer}{SCALE_SUFFIX}"), Kind::Legacy))
        .collect();
    scales.extend(
        (mixed.iter()).map(|&layer| (layer, format!("{layer}{WEIGHT_SCALE_SUFFIX}"), Kind::Mixed)),
    );
    for (layer, scale_name, kind) in scales {
        let weight_name = format!("{layer}.weight");
        let (Some(&wi), Some(&si)) = (
            index.get(weight_name.as_str()),
            index.get(scale_name.as_str()),
        ) else {
            // A legacy scale is a tensor of the file, so its weight is what is missing; a
            // mixed layer is named by its marker and lacks its weight or its scale.
            let missing = [&weight_name, &scale_name]
                .into_iter()
                .find(|name| !index.contains_key(name.as_str()))
                .expect("one of them is missing");
            let (named, what) = match kind {
                Kind::Legacy => (scale_name.clone(), "to scale"),
                Kind::Mixed => (
                    format!("{layer}{COMFY_QUANT_SUFFIX}"),
                    "for this quantized layer",
                ),
            };
            return Err(rule(&named, format!("no '{missing}' {what} ({format})")));
        };
        if let Some((_, other, _)) = pairs.iter().find(|(w, ..)| *w == wi) {
            return Err(rule(
                &weight_name,
                format!(
                    "two scales, '{}' and '{scale_name}': a weight has one",
                    entries[*other].name
                ),
            ));
        }
        pairs.push((wi, si, layout(format, kind, entries[wi], entries[si])?));
    }
    Ok(pairs)
}

/// Which kind of file a scale comes from: its name and the shapes its format allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `.scale_weight` (musubi, legacy ComfyUI).
    Legacy,
    /// `.weight_scale` of a marked or listed layer (ComfyUI mixed precision).
    Mixed,
}

fn rule(name: &str, rule: String) -> QuantizeError {
    QuantizeError::Prequantized(format!("tensor '{name}': {rule}"))
}

/// Checks one weight and its scale against `format`'s rules; its layout.
fn layout(
    format: Quantization,
    kind: Kind,
    weight: &TensorEntry,
    scale: &TensorEntry,
) -> Result<PreLayout, QuantizeError> {
    if weight.dtype != DType::F8E4M3 {
        let why = match kind {
            Kind::Legacy => {
                format!("a weight with a .scale_weight must be F8_E4M3 (float8_e4m3fn) in {format}")
            }
            Kind::Mixed => format!(
                "a ComfyUI quantized layer is read only as {COMFY_FP8_FORMAT} (an F8_E4M3 \
                 weight; nvfp4, mxfp8 and int8 layers are not read)"
            ),
        };
        return Err(rule(&weight.name, format!("dtype {}: {why}", weight.dtype)));
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
    let ok = match (kind, format) {
        (Kind::Mixed, _) => matches!(s, [] | [1]),
        (_, Quantization::Fp8ScaledComfy) => s.is_empty(),
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
        let needs = match (kind, format, w.len()) {
            (Kind::Mixed, ..) => "[] or [1] (one scale per weight)".to_string(),
            (_, Quantization::Fp8ScaledComfy, _) => "[] (one scale per weight)".to_string(),
            (.., 2) => format!(
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

/// The layout of a torchao weight declared for upload (`format` one of the `Torchao*`
/// quantizations): data of the format's dtype (F8_E4M3 for `torchao_float8_rowwise`, I8 for
/// `torchao_int8_rowwise`), one byte per element, of rank 2 ([out, in]: torchao quantizes
/// linear weights), and one fp32 scale per row (`scale_shape` [out, 1]: granularity PerRow()).
/// The slice is laid out as every pre-quantized weight's: data, zero padding to 16, scales.
pub fn torchao_layout(
    format: Quantization,
    name: &str,
    dtype: DType,
    shape: &[u64],
    scale_shape: &[u64],
) -> Result<PreLayout, QuantizeError> {
    let (data_dtype, tensor) = match format {
        Quantization::TorchaoFloat8Rowwise => (DType::F8E4M3, "Float8Tensor"),
        Quantization::TorchaoInt8Rowwise => (DType::I8, "Int8Tensor"),
        other => unreachable!("{other} is not a torchao format"),
    };
    if dtype != data_dtype {
        return Err(rule(
            name,
            format!("dtype {dtype}: {format} data (a torchao {tensor}'s qdata) is {data_dtype}"),
        ));
    }
    let &[out, inputs] = shape else {
        return Err(rule(
            name,
            format!(
                "shape {shape:?}: {format} holds 2-D weights [out_features, in_features] (a \
                 torchao {tensor} of a Linear layer)"
            ),
        ));
    };
    if scale_shape != [out, 1] {
        return Err(rule(
            name,
            format!(
                "scale shape {scale_shape:?} does not fit shape {shape:?}: {format} has one \
                 scale per row, [{out}, 1] (granularity PerRow())"
            ),
        ));
    }
    let overflow = || QuantizeError::ShapeOverflow {
        name: name.to_owned(),
        shape: shape.to_vec(),
    };
    let data_bytes = out.checked_mul(inputs).ok_or_else(overflow)?;
    let scale_offset = data_bytes
        .checked_next_multiple_of(SCALE_ALIGN)
        .ok_or_else(overflow)?;
    let nbytes = (out.checked_mul(4))
        .and_then(|scales| scale_offset.checked_add(scales))
        .ok_or_else(overflow)?;
    Ok(PreLayout {
        quantization: format,
        scale_shape: scale_shape.to_vec(),
        scale_dtype: DType::F32,
        data_bytes,
        scale_offset,
        nbytes,
    })
}

#[cfg(test)]
mod torchao_tests {
    use super::*;

    const F8: Quantization = Quantization::TorchaoFloat8Rowwise;
    const I8: Quantization = Quantization::TorchaoInt8Rowwise;

    /// Data, padding to 16 and one fp32 scale per row, for both formats.
    #[test]
    fn a_torchao_weight_is_data_padding_and_a_scale_per_row() {
        for (format, dtype) in [(F8, DType::F8E4M3), (I8, DType::I8)] {
            let l = torchao_layout(format, "w", dtype, &[3, 7], &[3, 1]).unwrap();
            assert_eq!(
                (l.data_bytes, l.scale_offset, l.nbytes, l.scale_shape),
                (21, 32, 32 + 12, vec![3, 1]),
                "{format}"
            );
            assert_eq!((l.quantization, l.scale_dtype), (format, DType::F32));
        }
    }

    /// Each broken rule is refused naming the tensor, what was given and what the format needs.
    #[test]
    fn each_broken_torchao_rule_names_the_tensor_and_the_rule() {
        /// (format, data dtype, shape, scale shape, the refusal).
        type Case<'a> = (Quantization, DType, &'a [u64], &'a [u64], &'a str);
        let cases: Vec<Case<'_>> = vec![
            (
                F8,
                DType::I8,
                &[4, 8],
                &[4, 1],
                "tensor 'w': dtype I8: torchao_float8_rowwise data (a torchao Float8Tensor's \
                 qdata) is F8_E4M3",
            ),
            (
                I8,
                DType::F8E4M3,
                &[4, 8],
                &[4, 1],
                "tensor 'w': dtype F8_E4M3: torchao_int8_rowwise data (a torchao Int8Tensor's \
                 qdata) is I8",
            ),
            (
                F8,
                DType::F8E4M3,
                &[2, 4, 8],
                &[2, 4, 1],
                "tensor 'w': shape [2, 4, 8]: torchao_float8_rowwise holds 2-D weights \
                 [out_features, in_features] (a torchao Float8Tensor of a Linear layer)",
            ),
            (
                F8,
                DType::F8E4M3,
                &[4, 8],
                &[1, 1],
                "tensor 'w': scale shape [1, 1] does not fit shape [4, 8]: \
                 torchao_float8_rowwise has one scale per row, [4, 1] (granularity PerRow())",
            ),
            (
                I8,
                DType::I8,
                &[4, 128],
                &[4, 2],
                "tensor 'w': scale shape [4, 2] does not fit shape [4, 128]: \
                 torchao_int8_rowwise has one scale per row, [4, 1] (granularity PerRow())",
            ),
            (
                I8,
                DType::I8,
                &[4, 8],
                &[4],
                "tensor 'w': scale shape [4] does not fit shape [4, 8]: torchao_int8_rowwise \
                 has one scale per row, [4, 1] (granularity PerRow())",
            ),
            (
                F8,
                DType::F8E4M3,
                &[u64::MAX, 2],
                &[u64::MAX, 1],
                "tensor 'w': shape [18446744073709551615, 2] has more elements than this \
                 machine can address",
            ),
        ];
        let failed: Vec<String> = (cases.iter())
            .filter_map(|(format, dtype, shape, scales, want)| {
                let got = torchao_layout(*format, "w", *dtype, shape, scales)
                    .map(|l| format!("{l:?}"))
                    .unwrap_or_else(|e| e.to_string());
                (got != *want).then(|| format!("{format} {shape:?}: want {want}, got {got}"))
            })
            .collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }
}
