//! Request validation at the boundary: every message is checked before it reaches the core,
//! and a bad one gets INVALID_ARGUMENT naming the field and the limit.
#![forbid(unsafe_code)]

use std::collections::HashSet;

use tonic::Status;
use weightstream_client::proto as pb;

use crate::config::Limits;
use crate::store::TensorDecl;
use crate::store::safetensors::tensor_nbytes;

/// Most dimensions a tensor may have.
pub const MAX_RANK: usize = 16;

pub struct Check {
    max_name: usize,
}

impl Check {
    pub fn new(limits: &Limits) -> Check {
        Check {
            max_name: limits.max_name_bytes as usize,
        }
    }

    /// A required string of at most `max` bytes.
    pub fn text(&self, field: &str, value: &str, max: usize) -> Result<(), Status> {
        if value.is_empty() {
            return Err(Status::invalid_argument(format!("{field}: required")));
        }
        self.text_opt(field, value, max)
    }

    pub fn text_opt(&self, field: &str, value: &str, max: usize) -> Result<(), Status> {
        if value.len() > max {
            return Err(Status::invalid_argument(format!(
                "{field}: {} bytes, the limit is {max}",
                value.len()
            )));
        }
        if value.contains('\0') {
            return Err(Status::invalid_argument(format!(
                "{field}: contains a NUL byte"
            )));
        }
        Ok(())
    }

    pub fn count(&self, field: &str, n: usize, min: usize, max: usize) -> Result<(), Status> {
        if n < min {
            return Err(Status::invalid_argument(format!(
                "{field}: {n} entries, at least {min} required"
            )));
        }
        if n > max {
            return Err(Status::invalid_argument(format!(
                "{field}: {n} entries, the limit is {max}"
            )));
        }
        Ok(())
    }
}

/// Optional names (model names, labels, group names) share the name limit.
pub fn check_name(check: &Check, field: &str, value: &str) -> Result<(), Status> {
    check.text_opt(field, value, check.max_name)
}

/// Validated upload tensors as (name, dtype, shape, nbytes).
pub fn check_upload_tensors(
    check: &Check,
    tensors: &[pb::TensorInfo],
) -> Result<Vec<TensorDecl>, Status> {
    check.count("tensors", tensors.len(), 1, usize::MAX)?;
    let mut names = HashSet::new();
    let mut out = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let field = format!("tensors[{i}]");
        check.text(&format!("{field}.name"), &t.name, check.max_name)?;
        if !names.insert(t.name.as_str()) {
            return Err(Status::invalid_argument(format!(
                "{field}.name: '{}' is declared twice",
                t.name
            )));
        }
        let dtype = super::service::upload_dtype(&format!("{field}.dtype"), t.dtype)?;
        if t.shape.len() > MAX_RANK {
            return Err(Status::invalid_argument(format!(
                "{field}.shape: {} dimensions, the limit is {MAX_RANK}",
                t.shape.len()
            )));
        }
        let nbytes = tensor_nbytes(dtype, &t.shape).ok_or_else(|| {
            Status::invalid_argument(format!("{field}.shape: {:?} overflows", t.shape))
        })?;
        if t.nbytes != 0 && t.nbytes != nbytes {
            return Err(Status::invalid_argument(format!(
                "{field}.nbytes: {} disagrees with shape {:?} of {dtype} ({nbytes} bytes)",
                t.nbytes, t.shape
            )));
        }
        out.push((t.name.clone(), dtype, t.shape.clone(), nbytes));
    }
    Ok(out)
}
