//! Request validation at the boundary: each request becomes a `Valid…` value whose fields are
//! checked and converted, or a [`ValidationError`] that names the field and the limit. The
//! handlers pass only validated values on to the core.

use std::collections::{BTreeSet, HashSet};
use std::num::NonZeroU64;

use weightstream_proto::handoff;
use weightstream_proto::v1 as pb;

use super::convert::{coding_from_pb, dtype_from_pb, quantization_from_pb, retention_from_pb};
use crate::config::{CopyRate, Limits, MIN_COPY_BANDWIDTH, Rate};
use crate::core::OpenRequest;
use crate::core::random_secret;
use crate::mem::shm::UploadPages;
use crate::store::coding::Coding;
use crate::store::prequantized::torchao_layout;
use crate::store::quantize::{Quantization, QuantizeError, StoredLayout, Target};
use crate::store::safetensors::{DType, tensor_nbytes};
use crate::store::{DeclQuant, QuantizedLayout, Retention, Selection, TensorDecl};

mod label;

/// Most dimensions a tensor may have.
pub const MAX_RANK: usize = 16;
/// Most paths one LoadModel may name (one per fd, and one handoff passes at most this many),
/// and the longest path.
pub const MAX_PATHS: usize = handoff::MAX_FDS;
pub const MAX_PATH_BYTES: usize = 4096;
/// Entries of a page of ListModels or ListSessions: by default, and at most.
pub const DEFAULT_PAGE_SIZE: usize = 100;
pub const MAX_PAGE_SIZE: usize = 1000;
/// The longest id (model, upload, session) a request may carry.
pub const MAX_ID_BYTES: usize = 256;

/// Why a request was refused: every variant names the field (`tensors[3].shape`) and the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("{field}: required")]
    Required { field: String },
    #[error("{field}: {len} bytes, the limit is {max}")]
    TooLong {
        field: String,
        len: usize,
        max: usize,
    },
    #[error("{field}: contains a NUL byte")]
    NulByte { field: String },
    #[error("{field}: {n} entries, at least {min} required")]
    TooFew { field: String, n: usize, min: usize },
    #[error("{field}: {n} entries, the limit is {max}")]
    TooMany { field: String, n: usize, max: usize },
    #[error("{field}: must be more than 0")]
    Zero { field: &'static str },
    #[error("{field}: {value} is more than {key} = {max}")]
    TooLarge {
        field: &'static str,
        value: u64,
        key: &'static str,
        max: u64,
    },
    #[error("{field}: {value} is below the least the daemon accepts, {min} (0: none)")]
    TooSlow {
        field: &'static str,
        value: Rate,
        min: Rate,
    },
    #[error("{field}: '{name}' is declared twice")]
    Duplicate { field: String, name: String },
    #[error("{field}: {value} is not a known dtype")]
    UnknownDtype { field: String, value: i32 },
    #[error(
        "{field}: {value} is not a known quantization (QUANTIZATION_NONE = 0, \
         QUANTIZATION_FP8_E4M3_BLOCK64 = 1, QUANTIZATION_FP8_E4M3_ROW = 6, \
         QUANTIZATION_INT8_ROW = 7; in BeginUpload also \
         QUANTIZATION_TORCHAO_FLOAT8_ROWWISE = 4, QUANTIZATION_TORCHAO_INT8_ROWWISE = 5)"
    )]
    UnknownQuantization { field: String, value: i32 },
    /// A torchao format is written pre-quantized by the client (BeginUpload), never made by
    /// the daemon from a file.
    #[error(
        "{field}: {name} is uploaded pre-quantized (BeginUpload with the weight's data and \
         scales), not made by a load: load with QUANTIZATION_NONE, \
         QUANTIZATION_FP8_E4M3_BLOCK64, QUANTIZATION_FP8_E4M3_ROW or QUANTIZATION_INT8_ROW"
    )]
    UploadOnlyQuantization { field: String, name: &'static str },
    #[error(
        "retention: {0} is not a known retention (RETENTION_CACHED = 0, RETENTION_CONNECTION = \
         1, RETENTION_PINNED = 2)"
    )]
    UnknownRetention(i32),
    #[error("{field}: {value} is not a known coding (CODING_NONE = 0, CODING_RANS8 = 1)")]
    UnknownCoding { field: &'static str, value: i32 },
    /// The coding fields of a tensor are the daemon's to set.
    #[error(
        "{field}: set by the daemon, 0 in BeginUpload: ask for coding in CommitUpload \
         (CommitUploadRequest.coding)"
    )]
    CodingInUpload { field: String },
    /// A pre-quantized format is read from files as published (a LoadModel with quantization
    /// none of such a file), never asked for.
    #[error(
        "{field}: {name} is read from pre-quantized files as they are: load such a file with \
         QUANTIZATION_NONE"
    )]
    ReadOnlyQuantization { field: String, name: &'static str },
    /// A tensor declared for quantization that cannot be quantized (rank, dtype).
    #[error("{field}: {source}")]
    Quantize {
        field: String,
        source: QuantizeError,
    },
    #[error(
        "{field}: tensor '{name}' declares {data} data without scales: pre-quantized \
         {format} needs scale_shape {expected:?}"
    )]
    NoScales {
        field: String,
        name: String,
        /// "fp8" or "int8".
        data: &'static str,
        format: Quantization,
        expected: [u64; 2],
    },
    #[error(
        "{field}: tensor '{name}': scale shape {given:?} does not match {expected:?}, the scales \
         of {format} of shape {shape:?}"
    )]
    ScaleShape {
        field: String,
        name: String,
        format: Quantization,
        given: Vec<u64>,
        expected: [u64; 2],
        shape: Vec<u64>,
    },
    #[error("{field}: {given} disagrees with the {format} layout of tensor '{name}' ({expected})")]
    ScaleOffset {
        field: String,
        name: String,
        format: &'static str,
        given: u64,
        expected: u64,
    },
    #[error("{field}: given for tensor '{name}', which {why}")]
    ScalesNotExpected {
        field: String,
        name: String,
        why: &'static str,
    },
    #[error(
        "fd_token: required — open the files in the client and pass them through the handoff \
         socket (the weightstream clients do)"
    )]
    NoFdToken,
    #[error(
        "fd_token: not a token: {} lowercase hex characters expected",
        handoff::SECRET_LEN
    )]
    BadFdToken,
    #[error("page_size: {0}, the limit is {MAX_PAGE_SIZE}")]
    PageSize(u32),
    #[error("page_token: '{0}' is not a token this list gave")]
    PageToken(String),
    #[error("{field}: {rank} dimensions, the limit is {MAX_RANK}")]
    Rank { field: String, rank: usize },
    #[error("{field}: {shape:?} overflows")]
    Overflow { field: String, shape: Vec<u64> },
    #[error("{field}: {given} disagrees with shape {shape:?} of {dtype} ({nbytes} bytes)")]
    Nbytes {
        field: String,
        given: u64,
        shape: Vec<u64>,
        dtype: DType,
        nbytes: u64,
    },
    #[error(transparent)]
    Label(#[from] label::LabelError),
}

type Result<T> = std::result::Result<T, ValidationError>;

/// LoadModel: the files passed under `fd_token`, and the names the peer gave them (display
/// names only: the daemon reads the fds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidLoadModel {
    pub paths: Vec<String>,
    pub name: String,
    pub fd_token: String,
    pub quantization: Quantization,
    pub coding: Coding,
    pub retention: Retention,
    /// The tensors to load; that each is in the files is the load's check (it reads them).
    pub tensors: Selection,
}

/// The lists that come in pages: a token of one is not a token of the other.
#[derive(Debug, Clone, Copy)]
pub enum PageList {
    Models,
    Sessions,
}

impl PageList {
    fn name(self) -> &'static str {
        match self {
            PageList::Models => "models",
            PageList::Sessions => "sessions",
        }
    }
}

/// A page of a list: how many entries, and after which (`T::default()`: from the start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidPage<T> {
    pub size: usize,
    pub after: T,
}

/// BeginUpload: each tensor's dtype known, its byte size computed from its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidBeginUpload {
    pub name: String,
    pub tensors: Vec<TensorDecl>,
    pub pages: UploadPages,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidCommitUpload {
    pub upload_id: String,
    pub retention: Retention,
    pub coding: Coding,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidAbortUpload {
    pub upload_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidReleaseModel {
    pub model_id: String,
    /// Every uid's references (the daemon's administrators only).
    pub all_references: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidCloseSession {
    pub session_id: String,
}

/// AllocStateRegion: `bytes` within 1 ..= `limits.max_state_region_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidAllocStateRegion {
    pub session_id: String,
    pub bytes: NonZeroU64,
    pub label: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidFreeStateRegion {
    pub session_id: String,
    pub region_id: String,
}

/// The checks, with the configured limits.
#[derive(Debug, Clone, Copy)]
pub struct Validation {
    /// The key of the page tokens this daemon gives: a token is the position it names and a
    /// keyed hash of it, so that a token no list gave is told apart (and refused) rather than
    /// read as a position.
    page_key: [u8; 32],
    max_name: usize,
    max_groups: usize,
    max_tensors: usize,
    max_state_region_bytes: u64,
}

impl Validation {
    pub fn new(limits: &Limits) -> Validation {
        // 256 bits from the kernel.
        let key = format!("{}{}", random_secret(), random_secret());
        Validation {
            page_key: *blake3::hash(key.as_bytes()).as_bytes(),
            max_name: limits.max_name_bytes as usize,
            max_groups: limits.max_groups_per_session as usize,
            max_tensors: limits.max_tensors_per_model as usize,
            max_state_region_bytes: limits.max_state_region_bytes,
        }
    }

    pub fn load_model(&self, req: pb::LoadModelRequest) -> Result<ValidLoadModel> {
        count("paths", req.paths.len(), 1, MAX_PATHS)?;
        for (i, p) in req.paths.iter().enumerate() {
            text(&format!("paths[{i}]"), p, MAX_PATH_BYTES)?;
        }
        self.name("name", &req.name)?;
        if req.fd_token.is_empty() {
            return Err(ValidationError::NoFdToken);
        }
        if !handoff::is_secret(&req.fd_token) {
            return Err(ValidationError::BadFdToken);
        }
        let quantization = quantization("quantization", req.quantization)?;
        if quantization.upload_only() {
            return Err(ValidationError::UploadOnlyQuantization {
                field: "quantization".into(),
                name: quantization.name(),
            });
        }
        Ok(ValidLoadModel {
            paths: req.paths,
            name: req.name,
            fd_token: req.fd_token,
            quantization,
            coding: coding("coding", req.coding)?,
            retention: retention(req.retention)?,
            tensors: self.selection(req.tensors)?,
        })
    }

    /// LoadModel's `tensors`: none is every tensor; else names, each once.
    fn selection(&self, tensors: Vec<String>) -> Result<Selection> {
        if tensors.is_empty() {
            return Ok(Selection::All);
        }
        count("tensors", tensors.len(), 1, self.max_tensors)?;
        let mut names = BTreeSet::new();
        for (i, name) in tensors.into_iter().enumerate() {
            let field = format!("tensors[{i}]");
            text(&field, &name, self.max_name)?;
            if names.contains(&name) {
                return Err(ValidationError::Duplicate { field, name });
            }
            names.insert(name);
        }
        Ok(Selection::Only(names))
    }

    /// The token of the page of `list` after `position`: opaque to clients.
    pub fn page_token(&self, list: PageList, position: &str) -> String {
        format!("{position}.{}", self.page_mac(list, position))
    }

    fn page_mac(&self, list: PageList, position: &str) -> String {
        let mut hasher = blake3::Hasher::new_keyed(&self.page_key);
        hasher.update(list.name().as_bytes());
        hasher.update(&[0]);
        hasher.update(position.as_bytes());
        let mac = hasher.finalize();
        mac.as_bytes()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The position a token of `list` names, if this daemon gave it (empty: the first page).
    fn page_position<'a>(&self, list: PageList, token: &'a str) -> Result<&'a str> {
        if token.is_empty() {
            return Ok("");
        }
        let refused = || ValidationError::PageToken(token.chars().take(64).collect());
        let (position, mac) = token.rsplit_once('.').ok_or_else(refused)?;
        if position.is_empty() || mac != self.page_mac(list, position) {
            return Err(refused());
        }
        Ok(position)
    }

    /// ListModels: after the model id the token names.
    pub fn list_models(&self, req: pb::ListModelsRequest) -> Result<ValidPage<String>> {
        text_opt("page_token", &req.page_token, MAX_ID_BYTES + 64)?;
        let after = self.page_position(PageList::Models, &req.page_token)?;
        Ok(ValidPage {
            size: page_size(req.page_size)?,
            after: after.to_string(),
        })
    }

    /// ListSessions: after the session the token names (by number).
    pub fn list_sessions(&self, req: pb::ListSessionsRequest) -> Result<ValidPage<u64>> {
        text_opt("page_token", &req.page_token, MAX_ID_BYTES + 64)?;
        let after = match self.page_position(PageList::Sessions, &req.page_token)? {
            "" => 0,
            position => position.parse().map_err(|_| {
                ValidationError::PageToken(req.page_token.chars().take(64).collect())
            })?,
        };
        Ok(ValidPage {
            size: page_size(req.page_size)?,
            after,
        })
    }

    /// BeginUpload's checks that take no time, whatever the request's size: what the
    /// async handler may run before handing the request to [`Validation::begin_upload`] on a
    /// blocking thread.
    pub fn begin_upload_bounds(&self, req: &pb::BeginUploadRequest) -> Result<()> {
        self.name("name", &req.name)?;
        count("tensors", req.tensors.len(), 1, self.max_tensors)
    }

    /// BeginUpload: every tensor checked (time and memory in proportion to their number: run
    /// it off the async threads), its names and shapes moved, not copied, into the result.
    pub fn begin_upload(&self, req: pb::BeginUploadRequest) -> Result<ValidBeginUpload> {
        self.begin_upload_bounds(&req)?;
        let tensors = self.upload_tensors(req.tensors)?;
        Ok(ValidBeginUpload {
            name: req.name,
            tensors,
            pages: if req.client_reserves {
                UploadPages::ByUploader
            } else {
                UploadPages::Reserved
            },
        })
    }

    pub fn commit_upload(&self, req: pb::CommitUploadRequest) -> Result<ValidCommitUpload> {
        text("upload_id", &req.upload_id, MAX_ID_BYTES)?;
        Ok(ValidCommitUpload {
            upload_id: req.upload_id,
            retention: retention(req.retention)?,
            coding: coding("coding", req.coding)?,
        })
    }

    pub fn abort_upload(&self, req: pb::AbortUploadRequest) -> Result<ValidAbortUpload> {
        text("upload_id", &req.upload_id, MAX_ID_BYTES)?;
        Ok(ValidAbortUpload {
            upload_id: req.upload_id,
        })
    }

    pub fn release_model(&self, req: pb::ReleaseModelRequest) -> Result<ValidReleaseModel> {
        text("model_id", &req.model_id, MAX_ID_BYTES)?;
        Ok(ValidReleaseModel {
            model_id: req.model_id,
            all_references: req.all_references,
        })
    }

    pub fn open_session(&self, req: pb::OpenSessionRequest) -> Result<OpenRequest> {
        text("model_id", &req.model_id, MAX_ID_BYTES)?;
        text_opt("device_uuid", &req.device_uuid, MAX_ID_BYTES)?;
        self.name("label", &req.label)?;
        let vram_budget = NonZeroU64::new(req.vram_budget).ok_or(ValidationError::Zero {
            field: "vram_budget",
        })?;
        let copy_bandwidth_limit = match req.copy_bandwidth_limit {
            0 => None,
            rate => Some(CopyRate::new(rate).ok_or(ValidationError::TooSlow {
                field: "copy_bandwidth_limit",
                value: Rate(rate),
                min: Rate(MIN_COPY_BANDWIDTH),
            })?),
        };
        count("groups", req.groups.len(), 1, self.max_groups)?;
        let mut groups = Vec::with_capacity(req.groups.len());
        for (i, g) in req.groups.into_iter().enumerate() {
            self.name(&format!("groups[{i}].name"), &g.name)?;
            count(
                &format!("groups[{i}].tensors"),
                g.tensors.len(),
                1,
                self.max_tensors,
            )?;
            groups.push((g.name, g.tensors));
        }
        Ok(OpenRequest {
            model_id: req.model_id,
            device_uuid: req.device_uuid,
            vram_budget,
            staging_bytes: req.staging_bytes,
            groups,
            label: req.label,
            copy_bandwidth_limit,
        })
    }

    pub fn close_session(&self, req: pb::CloseSessionRequest) -> Result<ValidCloseSession> {
        text("session_id", &req.session_id, MAX_ID_BYTES)?;
        Ok(ValidCloseSession {
            session_id: req.session_id,
        })
    }

    pub fn alloc_state_region(
        &self,
        req: pb::AllocStateRegionRequest,
    ) -> Result<ValidAllocStateRegion> {
        text("session_id", &req.session_id, MAX_ID_BYTES)?;
        self.name("label", &req.label)?;
        let bytes = NonZeroU64::new(req.bytes).ok_or(ValidationError::Zero { field: "bytes" })?;
        if bytes.get() > self.max_state_region_bytes {
            return Err(ValidationError::TooLarge {
                field: "bytes",
                value: bytes.get(),
                key: "limits.max_state_region_bytes",
                max: self.max_state_region_bytes,
            });
        }
        Ok(ValidAllocStateRegion {
            session_id: req.session_id,
            bytes,
            label: req.label,
        })
    }

    pub fn free_state_region(
        &self,
        req: pb::FreeStateRegionRequest,
    ) -> Result<ValidFreeStateRegion> {
        text("session_id", &req.session_id, MAX_ID_BYTES)?;
        text("region_id", &req.region_id, MAX_ID_BYTES)?;
        Ok(ValidFreeStateRegion {
            session_id: req.session_id,
            region_id: req.region_id,
        })
    }

    /// Optional names (model names, labels, group names) share the name limit.
    fn name(&self, field: &str, value: &str) -> Result<()> {
        text_opt(field, value, self.max_name)
    }

    /// Upload tensors: names unique, nbytes from the shape (and the fp8 layout), quantized ones
    /// quantizable, pre-quantized ones with the scales their shape needs.
    fn upload_tensors(&self, tensors: Vec<pb::TensorInfo>) -> Result<Vec<TensorDecl>> {
        let mut out = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.into_iter().enumerate() {
            let field = format!("tensors[{i}]");
            text(&format!("{field}.name"), &t.name, self.max_name)?;
            let dtype = dtype_from_pb(t.dtype).ok_or_else(|| ValidationError::UnknownDtype {
                field: format!("{field}.dtype"),
                value: t.dtype,
            })?;
            if t.shape.len() > MAX_RANK {
                return Err(ValidationError::Rank {
                    field: format!("{field}.shape"),
                    rank: t.shape.len(),
                });
            }
            let nbytes =
                tensor_nbytes(dtype, &t.shape).ok_or_else(|| ValidationError::Overflow {
                    field: format!("{field}.shape"),
                    shape: t.shape.clone(),
                })?;
            for (name, set) in [
                ("coding", t.coding != 0),
                ("stored_nbytes", t.stored_nbytes != 0),
                ("coded_lanes", t.coded_lanes != 0),
            ] {
                if set {
                    return Err(ValidationError::CodingInUpload {
                        field: format!("{field}.{name}"),
                    });
                }
            }
            let quant = upload_quantization(&field, &t, dtype)?;
            let quantization = quantization_from_pb(t.quantization).unwrap_or_default();
            let label = label::label(&field, &t.format, t.weights, quantization)?;
            let (nbytes, quant) = match quant {
                Declared::Plain => (nbytes, DeclQuant::None),
                Declared::AtCommit(layout) => (nbytes, DeclQuant::AtCommit(layout)),
                Declared::Prequantized(layout, nbytes) => (nbytes, DeclQuant::Prequantized(layout)),
            };
            if t.nbytes != 0 && t.nbytes != nbytes {
                return Err(ValidationError::Nbytes {
                    field: format!("{field}.nbytes"),
                    given: t.nbytes,
                    shape: t.shape,
                    dtype,
                    nbytes,
                });
            }
            out.push(TensorDecl {
                name: t.name,
                dtype,
                shape: t.shape,
                nbytes,
                quant,
                label,
            });
        }
        label::check_weights(out.iter().map(|t| t.label.as_ref()))?;
        let mut names = HashSet::with_capacity(out.len());
        for (i, t) in out.iter().enumerate() {
            if !names.insert(t.name.as_str()) {
                return Err(ValidationError::Duplicate {
                    field: format!("tensors[{i}].name"),
                    name: t.name.clone(),
                });
            }
        }
        Ok(out)
    }
}

fn retention(value: i32) -> Result<Retention> {
    retention_from_pb(value).ok_or(ValidationError::UnknownRetention(value))
}

fn coding(field: &'static str, value: i32) -> Result<Coding> {
    coding_from_pb(value).ok_or(ValidationError::UnknownCoding { field, value })
}

fn quantization(field: &str, value: i32) -> Result<Quantization> {
    let q = quantization_from_pb(value).ok_or_else(|| ValidationError::UnknownQuantization {
        field: field.to_string(),
        value,
    })?;
    if !q.requestable() {
        return Err(ValidationError::ReadOnlyQuantization {
            field: field.to_string(),
            name: q.name(),
        });
    }
    Ok(q)
}

/// An upload tensor's quantization as validated, with a pre-quantized one's slice bytes.
enum Declared {
    Plain,
    AtCommit(StoredLayout),
    Prequantized(QuantizedLayout, u64),
}

/// How an upload tensor (`field`, of known `dtype`) is quantized: not; at commit (a float
/// weight of rank >= 2); or already (the data of a format the daemon makes, F8_E4M3 or I8, with
/// the scales its shape needs, or a torchao format's data and scales,
/// `prequantized::torchao_layout`).
fn upload_quantization(field: &str, t: &pb::TensorInfo, dtype: DType) -> Result<Declared> {
    let q_field = format!("{field}.quantization");
    let scales_field = format!("{field}.scale_shape");
    let not_expected = |why| ValidationError::ScalesNotExpected {
        field: scales_field.clone(),
        name: t.name.clone(),
        why,
    };
    let q = quantization(&q_field, t.quantization)?;
    if q == Quantization::None {
        if !t.scale_shape.is_empty() || t.scale_offset != 0 {
            return Err(not_expected("is not quantized"));
        }
        return Ok(Declared::Plain);
    }
    let quantize_error = |source| ValidationError::Quantize {
        field: q_field.clone(),
        source,
    };
    if q.upload_only() {
        let layout =
            torchao_layout(q, &t.name, dtype, &t.shape, &t.scale_shape).map_err(quantize_error)?;
        if t.scale_offset != 0 && t.scale_offset != layout.scale_offset {
            return Err(ValidationError::ScaleOffset {
                field: format!("{field}.scale_offset"),
                name: t.name.clone(),
                format: q.name(),
                given: t.scale_offset,
                expected: layout.scale_offset,
            });
        }
        let stored = QuantizedLayout {
            quantization: q,
            scale_shape: layout.scale_shape,
            scale_offset: layout.scale_offset,
        };
        return Ok(Declared::Prequantized(stored, layout.nbytes));
    }
    // Requestable, not upload-only and not none: a format the daemon makes.
    let target = Target::of(q).expect("a format the daemon makes");
    let data = target.data_dtype();
    if dtype != data && !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Err(quantize_error(QuantizeError::DType {
            name: t.name.clone(),
            dtype,
        }));
    }
    let layout = StoredLayout::of(target, &t.name, &t.shape).map_err(quantize_error)?;
    if dtype != data {
        if !t.scale_shape.is_empty() || t.scale_offset != 0 {
            return Err(not_expected("the daemon quantizes at commit"));
        }
        return Ok(Declared::AtCommit(layout));
    }
    let expected = layout.block.scale_shape();
    if t.scale_shape.is_empty() {
        return Err(ValidationError::NoScales {
            field: scales_field,
            name: t.name.clone(),
            data: if data == DType::I8 { "int8" } else { "fp8" },
            format: q,
            expected,
        });
    }
    if t.scale_shape != expected {
        return Err(ValidationError::ScaleShape {
            field: scales_field,
            name: t.name.clone(),
            format: q,
            given: t.scale_shape.clone(),
            expected,
            shape: t.shape.clone(),
        });
    }
    if t.scale_offset != 0 && t.scale_offset != layout.scale_offset {
        return Err(ValidationError::ScaleOffset {
            field: format!("{field}.scale_offset"),
            name: t.name.clone(),
            format: q.name(),
            given: t.scale_offset,
            expected: layout.scale_offset,
        });
    }
    Ok(Declared::Prequantized(
        QuantizedLayout::made(&layout),
        layout.nbytes,
    ))
}

fn page_size(given: u32) -> Result<usize> {
    match given as usize {
        0 => Ok(DEFAULT_PAGE_SIZE),
        n if n <= MAX_PAGE_SIZE => Ok(n),
        _ => Err(ValidationError::PageSize(given)),
    }
}

/// A required string of at most `max` bytes.
fn text(field: &str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() {
        return Err(ValidationError::Required {
            field: field.to_string(),
        });
    }
    text_opt(field, value, max)
}

/// An optional string (empty is fine) of at most `max` bytes.
fn text_opt(field: &str, value: &str, max: usize) -> Result<()> {
    if value.len() > max {
        return Err(ValidationError::TooLong {
            field: field.to_string(),
            len: value.len(),
            max,
        });
    }
    if value.contains('\0') {
        return Err(ValidationError::NulByte {
            field: field.to_string(),
        });
    }
    Ok(())
}

fn count(field: &str, n: usize, min: usize, max: usize) -> Result<()> {
    if n < min {
        return Err(ValidationError::TooFew {
            field: field.to_string(),
            n,
            min,
        });
    }
    if n > max {
        return Err(ValidationError::TooMany {
            field: field.to_string(),
            n,
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
