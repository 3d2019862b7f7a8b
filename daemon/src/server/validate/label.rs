//! Upload tensors' format labels (`TensorInfo.format`, `.weights`): a client's name for the
//! packed format of a layer's raw tensors, checked here so that `status` shows only short,
//! printable names with the weights that make their bits per weight.

use crate::store::formats::{FormatLabel, MAX_LABEL_BYTES, is_daemon_name};
use crate::store::quantize::Quantization;

/// Why a tensor's label was refused; each names the field and says what to send instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("{field}: {len} bytes, the limit is {MAX_LABEL_BYTES}")]
    TooLong { field: String, len: usize },
    #[error(
        "{field}: byte {at} is {ch:?}: a format label is ASCII letters, digits, '.', '_' and '-'"
    )]
    Charset { field: String, at: usize, ch: char },
    #[error(
        "{field}: '{name}' is a name the daemon gives its own formats (a dtype or a \
         quantization): name a packed format after its library (\"aitk.uint4\")"
    )]
    Reserved { field: String, name: String },
    #[error(
        "{field}: given for a tensor of quantization {quantization}, which the daemon names \
         itself: label only tensors uploaded as they are (QUANTIZATION_NONE)"
    )]
    Quantized {
        field: String,
        quantization: &'static str,
    },
    #[error(
        "{field}: {weights} without a format: weights count only for a labelled tensor (set \
         format, or send 0)"
    )]
    WeightsWithoutFormat { field: String, weights: u64 },
    #[error(
        "{field}: no tensor labelled '{name}' counts its weights: set weights (a layer's out x \
         in) on one tensor of each layer"
    )]
    NoWeights { field: String, name: String },
}

/// The label of upload tensor `field` (`tensors[3]`) of `quantization`, if it has one.
pub fn label(
    field: &str,
    format: &str,
    weights: u64,
    quantization: Quantization,
) -> Result<Option<FormatLabel>, LabelError> {
    let format_field = || format!("{field}.format");
    if format.is_empty() {
        if weights != 0 {
            return Err(LabelError::WeightsWithoutFormat {
                field: format!("{field}.weights"),
                weights,
            });
        }
        return Ok(None);
    }
    if format.len() > MAX_LABEL_BYTES {
        return Err(LabelError::TooLong {
            field: format_field(),
            len: format.len(),
        });
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if let Some((at, ch)) = format.char_indices().find(|(_, c)| !allowed(*c)) {
        return Err(LabelError::Charset {
            field: format_field(),
            at,
            ch,
        });
    }
    if is_daemon_name(format) {
        return Err(LabelError::Reserved {
            field: format_field(),
            name: format.to_string(),
        });
    }
    if quantization != Quantization::None {
        return Err(LabelError::Quantized {
            field: format_field(),
            quantization: quantization.name(),
        });
    }
    Ok(Some(FormatLabel {
        name: format.to_string(),
        weights,
    }))
}

/// Every label of an upload counts some weights (else its bits per weight would be
/// undefined); the first tensor of a label that counts none is named.
pub fn check_weights<'a>(
    labels: impl IntoIterator<Item = Option<&'a FormatLabel>>,
) -> Result<(), LabelError> {
    let mut first: Vec<(&str, usize)> = Vec::new();
    let mut counted: std::collections::HashSet<&str> = Default::default();
    for (i, l) in labels.into_iter().enumerate() {
        let Some(l) = l else { continue };
        if !first.iter().any(|(n, _)| *n == l.name) {
            first.push((&l.name, i));
        }
        if l.weights > 0 {
            counted.insert(&l.name);
        }
    }
    match first.into_iter().find(|(n, _)| !counted.contains(n)) {
        Some((name, i)) => Err(LabelError::NoWeights {
            field: format!("tensors[{i}].format"),
            name: name.to_string(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each bad label is refused with its field named; good ones pass.
    #[test]
    fn each_bad_label_names_its_field() {
        let none = Quantization::None;
        let long = "x".repeat(65);
        let cases: Vec<(&str, u64, Quantization, Result<bool, &str>)> = vec![
            ("", 0, none, Ok(false)),
            ("aitk.uint4", 4096, none, Ok(true)),
            ("torchao.NF4Tensor", 0, none, Ok(true)),
            (&long[..64], 1, none, Ok(true)),
            (
                "",
                4096,
                none,
                Err(
                    "tensors[2].weights: 4096 without a format: weights count only for a \
                     labelled tensor (set format, or send 0)",
                ),
            ),
            (
                &long,
                1,
                none,
                Err("tensors[2].format: 65 bytes, the limit is 64"),
            ),
            (
                "aitk uint4",
                1,
                none,
                Err(
                    "tensors[2].format: byte 4 is ' ': a format label is ASCII letters, \
                     digits, '.', '_' and '-'",
                ),
            ),
            (
                "nf4\u{1b}[2J",
                1,
                none,
                Err(
                    "tensors[2].format: byte 3 is '\\u{1b}': a format label is ASCII letters, \
                     digits, '.', '_' and '-'",
                ),
            ),
            (
                "BF16",
                1,
                none,
                Err(
                    "tensors[2].format: 'BF16' is a name the daemon gives its own formats (a \
                     dtype or a quantization): name a packed format after its library \
                     (\"aitk.uint4\")",
                ),
            ),
            (
                "aitk.uint4",
                1,
                Quantization::Fp8E4m3Block64,
                Err(
                    "tensors[2].format: given for a tensor of quantization fp8_e4m3_block64, \
                     which the daemon names itself: label only tensors uploaded as they are \
                     (QUANTIZATION_NONE)",
                ),
            ),
        ];
        let failed: Vec<String> = (cases.iter())
            .filter_map(|(format, weights, q, want)| {
                let got = label("tensors[2]", format, *weights, *q)
                    .map(|l| l.is_some())
                    .map_err(|e| e.to_string());
                let want = want.map_err(str::to_string);
                (got != want).then(|| format!("{format:?}: want {want:?}, got {got:?}"))
            })
            .collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }

    #[test]
    fn each_label_counts_weights_on_some_tensor() {
        let l = |name: &str, weights| {
            Some(FormatLabel {
                name: name.into(),
                weights,
            })
        };
        let fine = [l("a", 0), None, l("a", 8), l("b", 4)];
        assert_eq!(check_weights(fine.iter().map(Option::as_ref)), Ok(()));
        let bad = [l("a", 8), None, l("b", 0), l("b", 0)];
        assert_eq!(
            check_weights(bad.iter().map(Option::as_ref))
                .unwrap_err()
                .to_string(),
            "tensors[2].format: no tensor labelled 'b' counts its weights: set weights (a \
             layer's out x in) on one tensor of each layer"
        );
    }
}
