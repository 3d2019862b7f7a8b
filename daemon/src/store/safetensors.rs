//! Safetensors header parsing and validation.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header describing each
//! tensor, then the data section. Every number in it comes from whoever wrote the file, so the
//! length prefix is checked against a hard cap and the real file length before any buffer of
//! that size is allocated, and the JSON is parsed straight into the few fields we need (no
//! generic JSON tree), so a malformed or hostile file is rejected with a precise message instead
//! of exhausting memory or sending a later copy outside the file. The checks are at least as
//! strict as the `safetensors` crate's, so a file accepted here also loads there.
//!
//! No message quotes the file's bytes: not the length prefix (the first 8 bytes of whatever
//! file it is), not a JSON value of the wrong type, not a dtype or metadata string. Messages
//! name tensors, by the names the header gives them, and say what is wrong.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::Read;

use serde::de::{
    self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Unexpected, Visitor,
};

/// Largest header accepted: the cap of the `safetensors` crate (`MAX_HEADER_SIZE`), so that both
/// accept the same files.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Most tensors one header may list when no smaller limit is given; bounds the memory a header
/// can make us spend.
pub const MAX_TENSORS: usize = 1_000_000;

/// What one header may hold, checked while it is parsed, before an entry past a limit is
/// kept: the daemon's `limits.max_tensors_per_model` and `limits.max_name_bytes`, so that a
/// file is held to the limits an upload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderLimits {
    pub max_tensors: usize,
    pub max_name_bytes: usize,
}

impl HeaderLimits {
    /// The parser's own bounds alone.
    pub const NONE: HeaderLimits = HeaderLimits {
        max_tensors: MAX_TENSORS,
        max_name_bytes: usize::MAX,
    };
}

/// Size of the little-endian header length that starts every file.
const LEN_PREFIX: u64 = 8;

const METADATA_KEY: &str = "__metadata__";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl DType {
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::F8E5M2,
        DType::F8E4M3,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::F64,
        DType::I64,
        DType::U64,
    ];

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E5M2 | DType::F8E4M3 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The spelling used in safetensors headers.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E5M2 => "F8_E5M2",
            DType::F8E4M3 => "F8_E4M3",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::U64 => "U64",
        }
    }

    /// Inverse of [`DType::name`]; exact match, as the format is case-sensitive.
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Absolute byte offset of the tensor's data in the file (8 + header_len + begin).
    pub file_offset: u64,
    pub nbytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Sorted by file_offset.
    pub tensors: Vec<TensorEntry>,
    pub header_len: u64,
    /// Free-form "__metadata__" map, if present (string to string).
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("file is {file_len} bytes, shorter than the 8-byte header length")]
    FileTooShort { file_len: u64 },
    /// Over [`MAX_HEADER_BYTES`] or past the end of the file; the value is not said (it is the
    /// file's first 8 bytes).
    #[error("not a safetensors file: the header length is not plausible")]
    ImplausibleHeaderLength,
    #[error("cannot read the header: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid header: {0}")]
    InvalidHeader(String),
    #[error("the header lists more than {limit} tensors: limits.max_tensors_per_model = {limit}")]
    TooManyTensors { limit: usize },
    /// The name is not quoted: it may be megabytes long.
    #[error(
        "tensor {index} of the header has a name of {len} bytes: limits.max_name_bytes = {limit}"
    )]
    NameTooLong {
        index: usize,
        len: usize,
        limit: usize,
    },
    #[error("duplicate tensor name '{name}'")]
    DuplicateTensor { name: String },
    #[error(
        "tensor '{tensor}': unknown dtype (not one of BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, \
         F16, BF16, I32, U32, F32, F64, I64, U64)"
    )]
    UnknownDType { tensor: String },
    #[error("tensor '{tensor}': data_offsets [{begin}, {end}] end before they begin")]
    OffsetsReversed {
        tensor: String,
        begin: u64,
        end: u64,
    },
    #[error(
        "tensor '{tensor}': data_offsets end {end} is beyond the data section of {data_len} bytes"
    )]
    OffsetsPastData {
        tensor: String,
        end: u64,
        data_len: u64,
    },
    #[error(
        "tensor '{tensor}': shape {shape:?} of {dtype} is more than {} bytes",
        u64::MAX
    )]
    ShapeOverflow {
        tensor: String,
        shape: Vec<u64>,
        dtype: DType,
    },
    #[error(
        "tensor '{tensor}': shape {shape:?} of {dtype} is {nbytes} bytes but data_offsets span {span} bytes"
    )]
    SizeMismatch {
        tensor: String,
        shape: Vec<u64>,
        dtype: DType,
        nbytes: u64,
        span: u64,
    },
    #[error("tensors '{first}' and '{second}' overlap: {first_range:?} and {second_range:?}")]
    Overlap {
        first: String,
        first_range: [u64; 2],
        second: String,
        second_range: [u64; 2],
    },
    #[error(
        "data section bytes [{begin}, {end}){} are not covered by any tensor (the format requires every byte to belong to a tensor)",
        after_note(.after.as_deref())
    )]
    Uncovered {
        begin: u64,
        end: u64,
        /// The tensor the uncovered bytes follow, None when they start the data section.
        after: Option<String>,
    },
}

fn after_note(after: Option<&str>) -> String {
    after.map_or_else(String::new, |name| format!(" after tensor '{name}'"))
}

/// Number of bytes of a tensor of this dtype and shape, None on overflow.
///
/// A zero dimension makes the tensor empty, but the other dimensions must still multiply
/// without overflow: such a shape is nonsense whatever order its dimensions come in.
pub fn tensor_nbytes(dtype: DType, shape: &[u64]) -> Option<u64> {
    let mut bytes = dtype.size();
    let mut empty = false;
    for &dim in shape {
        if dim == 0 {
            empty = true;
        } else {
            bytes = bytes.checked_mul(dim)?;
        }
    }
    Some(if empty { 0 } else { bytes })
}

/// Reads and validates the header of a safetensors file of `file_len` bytes, held to `limits`.
/// Reads the 8-byte length first and checks it against MAX_HEADER_BYTES and the file length
/// BEFORE allocating a buffer of that size.
pub fn read_header<R: Read>(
    reader: &mut R,
    file_len: u64,
    limits: HeaderLimits,
) -> Result<Header, HeaderError> {
    check_file_len(file_len)?;
    let mut prefix = [0u8; LEN_PREFIX as usize];
    reader.read_exact(&mut prefix)?;
    let header_len = checked_header_len(prefix, file_len)?;
    // checked_header_len capped it at MAX_HEADER_BYTES, which fits any usize we build for.
    let buf_len = usize::try_from(header_len).map_err(|_| HeaderError::ImplausibleHeaderLength)?;
    let mut json = vec![0u8; buf_len];
    reader.read_exact(&mut json)?;
    parse_checked(&json, header_len, file_len, limits)
}

/// Same, on bytes already in memory (e.g. an mmap): `bytes.len()` is the file length.
pub fn parse_header(bytes: &[u8], limits: HeaderLimits) -> Result<Header, HeaderError> {
    let file_len = bytes.len() as u64;
    let Some(prefix) = bytes.first_chunk::<{ LEN_PREFIX as usize }>() else {
        return Err(HeaderError::FileTooShort { file_len });
    };
    let header_len = checked_header_len(*prefix, file_len)?;
    let json = usize::try_from(LEN_PREFIX + header_len)
        .ok()
        .and_then(|end| bytes.get(LEN_PREFIX as usize..end))
        .ok_or(HeaderError::ImplausibleHeaderLength)?;
    parse_checked(json, header_len, file_len, limits)
}

fn check_file_len(file_len: u64) -> Result<(), HeaderError> {
    if file_len < LEN_PREFIX {
        return Err(HeaderError::FileTooShort { file_len });
    }
    Ok(())
}

/// The header length from the prefix, once it is known to be sane for a file of `file_len`.
fn checked_header_len(prefix: [u8; 8], file_len: u64) -> Result<u64, HeaderError> {
    check_file_len(file_len)?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES || header_len > file_len - LEN_PREFIX {
        return Err(HeaderError::ImplausibleHeaderLength);
    }
    Ok(header_len)
}

/// Parses and validates header JSON whose length already passed `checked_header_len`.
fn parse_checked(
    json: &[u8],
    header_len: u64,
    file_len: u64,
    limits: HeaderLimits,
) -> Result<Header, HeaderError> {
    let text = std::str::from_utf8(json)
        .map_err(|e| HeaderError::InvalidHeader(format!("not valid UTF-8: {e}")))?;
    let raw = parse_json(text, limits)?;
    let data_start = LEN_PREFIX + header_len;
    let tensors = validate_tensors(raw.tensors, data_start, file_len - data_start)?;
    Ok(Header {
        tensors,
        header_len,
        metadata: raw.metadata,
    })
}

/// A tensor entry as written, before its values are checked.
struct RawTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offsets: [u64; 2],
}

struct RawHeader {
    tensors: Vec<RawTensor>,
    metadata: BTreeMap<String, String>,
}

fn parse_json(text: &str, limits: HeaderLimits) -> Result<RawHeader, HeaderError> {
    let mut over = None;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = HeaderSeed {
        limits,
        over: &mut over,
    }
    .deserialize(&mut de)
    // Trailing spaces are the writer's alignment padding; anything else is garbage.
    .and_then(|raw| de.end().map(|()| raw));
    parsed.map_err(|e| over.unwrap_or_else(|| HeaderError::InvalidHeader(e.to_string())))
}

/// Checks every entry, then how the entries tile the data section; returns them by offset.
fn validate_tensors(
    raw: Vec<RawTensor>,
    data_start: u64,
    data_len: u64,
) -> Result<Vec<TensorEntry>, HeaderError> {
    check_unique_names(&raw)?;
    let mut tensors = raw
        .into_iter()
        .map(|t| check_tensor(t, data_start, data_len))
        .collect::<Result<Vec<_>, _>>()?;
    // Name breaks ties between empty tensors so the order never depends on the header's.
    tensors.sort_by(|a, b| {
        (a.file_offset, a.nbytes, &a.name).cmp(&(b.file_offset, b.nbytes, &b.name))
    });
    check_coverage(&tensors, data_start, data_len)?;
    Ok(tensors)
}

fn check_unique_names(raw: &[RawTensor]) -> Result<(), HeaderError> {
    let mut seen = HashSet::with_capacity(raw.len());
    match raw.iter().find(|t| !seen.insert(t.name.as_str())) {
        Some(dup) => Err(HeaderError::DuplicateTensor {
            name: dup.name.clone(),
        }),
        None => Ok(()),
    }
}

fn check_tensor(
    raw: RawTensor,
    data_start: u64,
    data_len: u64,
) -> Result<TensorEntry, HeaderError> {
    let Some(dtype) = DType::from_name(&raw.dtype) else {
        return Err(HeaderError::UnknownDType { tensor: raw.name });
    };
    let [begin, end] = raw.offsets;
    if begin > end {
        return Err(HeaderError::OffsetsReversed {
            tensor: raw.name,
            begin,
            end,
        });
    }
    if end > data_len {
        return Err(HeaderError::OffsetsPastData {
            tensor: raw.name,
            end,
            data_len,
        });
    }
    let Some(nbytes) = tensor_nbytes(dtype, &raw.shape) else {
        return Err(HeaderError::ShapeOverflow {
            tensor: raw.name,
            shape: raw.shape,
            dtype,
        });
    };
    if nbytes != end - begin {
        return Err(HeaderError::SizeMismatch {
            tensor: raw.name,
            shape: raw.shape,
            dtype,
            nbytes,
            span: end - begin,
        });
    }
    Ok(TensorEntry {
        name: raw.name,
        dtype,
        shape: raw.shape,
        // Cannot overflow: begin <= data_len, and data_start + data_len is the file length.
        file_offset: data_start + begin,
        nbytes,
    })
}

/// The tensors, sorted by offset, must cover the data section exactly once: no two share a
/// byte and no byte belongs to none. Empty tensors own no bytes, so they are skipped.
fn check_coverage(
    tensors: &[TensorEntry],
    data_start: u64,
    data_len: u64,
) -> Result<(), HeaderError> {
    let mut covered_to = 0u64;
    let mut last: Option<&TensorEntry> = None;
    for t in tensors.iter().filter(|t| t.nbytes > 0) {
        let [begin, end] = header_range(t, data_start);
        if let Some(prev) = last.filter(|_| begin < covered_to) {
            return Err(HeaderError::Overlap {
                first: prev.name.clone(),
                first_range: header_range(prev, data_start),
                second: t.name.clone(),
                second_range: [begin, end],
            });
        }
        if begin > covered_to {
            return Err(uncovered(covered_to, begin, last));
        }
        covered_to = end;
        last = Some(t);
    }
    if covered_to < data_len {
        return Err(uncovered(covered_to, data_len, last));
    }
    Ok(())
}

/// The tensor's data_offsets as written in the header, which is what the user can look up.
fn header_range(t: &TensorEntry, data_start: u64) -> [u64; 2] {
    let begin = t.file_offset - data_start;
    [begin, begin + t.nbytes]
}

fn uncovered(begin: u64, end: u64, after: Option<&TensorEntry>) -> HeaderError {
    HeaderError::Uncovered {
        begin,
        end,
        after: after.map(|t| t.name.clone()),
    }
}

// JSON decoding. Hand-written visitors rather than derives or `serde_json::Value` because they
// catch duplicate keys (a map would silently keep one of them), stop at a limit (tensors, name
// bytes) before storing more, name the tensor and field in every type error, and never quote a value: each
// reads with `deserialize_any`, so that a value of the wrong type reaches its `visit_*` (see
// `refuse!`) instead of serde_json's own message, which quotes it.

/// `visit_*` methods that refuse a JSON value of the wrong type by its kind alone.
macro_rules! refuse {
    ($($kind:ident),*) => { $( refuse!(@ $kind); )* };
    (@ str) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Err(E::invalid_type(Unexpected::Other("a string"), &self))
        }
    };
    (@ bool) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Err(E::invalid_type(Unexpected::Other("a boolean"), &self))
        }
    };
    (@ i64) => {
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Err(E::invalid_type(Unexpected::Other("a negative integer"), &self))
        }
    };
    (@ u64) => {
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Err(E::invalid_type(Unexpected::Other("an integer"), &self))
        }
    };
    (@ f64) => {
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            let what = "a number that is not an integer of 64 bits";
            Err(E::invalid_type(Unexpected::Other(what), &self))
        }
    };
    (@ unit) => {
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Err(E::invalid_type(Unexpected::Other("null"), &self))
        }
    };
}

/// The top-level object; sets `over` when it stops at one of `limits`, so that the caller can
/// tell that abort from a JSON error.
struct HeaderSeed<'a> {
    limits: HeaderLimits,
    over: &'a mut Option<HeaderError>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = RawHeader;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<RawHeader, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object mapping tensor names to their dtype, shape and data_offsets")
    }

    refuse!(str, bool, i64, u64, f64, unit);

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let mut tensors = Vec::new();
        let mut metadata = None;
        while let Some(key) = map.next_key::<String>()? {
            if key == METADATA_KEY {
                if metadata.is_some() {
                    return Err(de::Error::custom("duplicate key '__metadata__'"));
                }
                metadata = Some(map.next_value_seed(MetadataSeed)?);
            } else if tensors.len() >= self.limits.max_tensors {
                *self.over = Some(HeaderError::TooManyTensors {
                    limit: self.limits.max_tensors,
                });
                return Err(de::Error::custom("too many tensors"));
            } else if key.len() > self.limits.max_name_bytes {
                *self.over = Some(HeaderError::NameTooLong {
                    index: tensors.len(),
                    len: key.len(),
                    limit: self.limits.max_name_bytes,
                });
                return Err(de::Error::custom("name too long"));
            } else {
                tensors.push(map.next_value_seed(TensorSeed { name: key })?);
            }
        }
        Ok(RawHeader {
            tensors,
            metadata: metadata.unwrap_or_default(),
        })
    }
}

/// One tensor entry; unknown fields are ignored, as the `safetensors` crate does.
struct TensorSeed {
    name: String,
}

impl<'de> DeserializeSeed<'de> for TensorSeed {
    type Value = RawTensor;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<RawTensor, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TensorSeed {
    type Value = RawTensor;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tensor '{}' to be an object with dtype, shape and data_offsets",
            self.name
        )
    }

    refuse!(str, bool, i64, u64, f64, unit);

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawTensor, A::Error> {
        let tensor = self.name.as_str();
        let mut dtype = None;
        let mut shape = None;
        let mut offsets = None;
        while let Some(field) = map.next_key::<String>()? {
            match field.as_str() {
                "dtype" => next_field(&mut map, &mut dtype, StrSeed { tensor }, tensor, "dtype")?,
                "shape" => next_field(&mut map, &mut shape, ShapeSeed { tensor }, tensor, "shape")?,
                "data_offsets" => {
                    let seed = OffsetsSeed { tensor };
                    next_field(&mut map, &mut offsets, seed, tensor, "data_offsets")?
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(RawTensor {
            dtype: required(dtype, tensor, "dtype")?,
            shape: required(shape, tensor, "shape")?,
            offsets: required(offsets, tensor, "data_offsets")?,
            name: self.name,
        })
    }
}

/// Reads a field's value into `slot`, refusing a second copy of the field: which copy wins
/// would otherwise depend on the reader.
fn next_field<'de, A, S>(
    map: &mut A,
    slot: &mut Option<S::Value>,
    seed: S,
    tensor: &str,
    field: &str,
) -> Result<(), A::Error>
where
    A: MapAccess<'de>,
    S: DeserializeSeed<'de>,
{
    if slot.is_some() {
        return Err(de::Error::custom(format_args!(
            "tensor '{tensor}': duplicate field '{field}'"
        )));
    }
    *slot = Some(map.next_value_seed(seed)?);
    Ok(())
}

fn required<T, E: de::Error>(value: Option<T>, tensor: &str, field: &str) -> Result<T, E> {
    value.ok_or_else(|| E::custom(format_args!("tensor '{tensor}': missing field '{field}'")))
}

/// A tensor's dtype string; whether it names a known dtype is checked later, with its own error.
struct StrSeed<'a> {
    tensor: &'a str,
}

impl<'de> DeserializeSeed<'de> for StrSeed<'_> {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<String, D::Error> {
        de.deserialize_any(self)
    }
}

impl Visitor<'_> for StrSeed<'_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a dtype string for tensor '{}'", self.tensor)
    }

    refuse!(bool, i64, u64, f64, unit);

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
}

struct ShapeSeed<'a> {
    tensor: &'a str,
}

impl<'de> DeserializeSeed<'de> for ShapeSeed<'_> {
    type Value = Vec<u64>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Vec<u64>, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ShapeSeed<'_> {
    type Value = Vec<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a shape array for tensor '{}'", self.tensor)
    }

    refuse!(str, bool, i64, u64, f64, unit);

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        let mut dims = Vec::new();
        let dim = U64Seed {
            tensor: self.tensor,
            field: "shape",
        };
        while let Some(d) = seq.next_element_seed(dim)? {
            dims.push(d);
        }
        Ok(dims)
    }
}

struct OffsetsSeed<'a> {
    tensor: &'a str,
}

impl<'de> DeserializeSeed<'de> for OffsetsSeed<'_> {
    type Value = [u64; 2];

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<[u64; 2], D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for OffsetsSeed<'_> {
    type Value = [u64; 2];

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "data_offsets [begin, end] for tensor '{}'", self.tensor)
    }

    refuse!(str, bool, i64, u64, f64, unit);

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<[u64; 2], A::Error> {
        let offset = U64Seed {
            tensor: self.tensor,
            field: "data_offsets",
        };
        let begin = seq
            .next_element_seed(offset)?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let end = seq
            .next_element_seed(offset)?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(de::Error::custom(format_args!(
                "tensor '{}': data_offsets has more than 2 elements",
                self.tensor
            )));
        }
        Ok([begin, end])
    }
}

/// A dimension or an offset: a JSON integer in 0..=u64::MAX.
#[derive(Clone, Copy)]
struct U64Seed<'a> {
    tensor: &'a str,
    field: &'static str,
}

impl<'de> DeserializeSeed<'de> for U64Seed<'_> {
    type Value = u64;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<u64, D::Error> {
        de.deserialize_any(self)
    }
}

impl Visitor<'_> for U64Seed<'_> {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "non-negative integers in {} of tensor '{}'",
            self.field, self.tensor
        )
    }

    refuse!(str, bool, i64, f64, unit);

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
}

/// `__metadata__`: an object of string values, each key once.
struct MetadataSeed;

impl<'de> DeserializeSeed<'de> for MetadataSeed {
    type Value = BTreeMap<String, String>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MetadataSeed {
    type Value = BTreeMap<String, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("__metadata__ to be an object of string values")
    }

    refuse!(str, bool, i64, u64, f64, unit);

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut metadata = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            if metadata.contains_key(&key) {
                return Err(de::Error::custom("__metadata__: a key appears twice"));
            }
            let value = map.next_value_seed(MetadataValueSeed)?;
            metadata.insert(key, value);
        }
        Ok(metadata)
    }
}

struct MetadataValueSeed;

impl<'de> DeserializeSeed<'de> for MetadataValueSeed {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<String, D::Error> {
        de.deserialize_any(self)
    }
}

impl Visitor<'_> for MetadataValueSeed {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("string values in __metadata__")
    }

    refuse!(bool, i64, u64, f64, unit);

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::Cursor;

    fn st_dtype(d: DType) -> ::safetensors::Dtype {
        use ::safetensors::Dtype as S;
        match d {
            DType::Bool => S::BOOL,
            DType::U8 => S::U8,
            DType::I8 => S::I8,
            DType::F8E5M2 => S::F8_E5M2,
            DType::F8E4M3 => S::F8_E4M3,
            DType::I16 => S::I16,
            DType::U16 => S::U16,
            DType::F16 => S::F16,
            DType::BF16 => S::BF16,
            DType::I32 => S::I32,
            DType::U32 => S::U32,
            DType::F32 => S::F32,
            DType::F64 => S::F64,
            DType::I64 => S::I64,
            DType::U64 => S::U64,
        }
    }

    struct Spec {
        name: &'static str,
        dtype: DType,
        shape: Vec<u64>,
        data: Vec<u8>,
    }

    fn spec(i: usize, name: &'static str, dtype: DType, shape: &[u64]) -> Spec {
        let n = tensor_nbytes(dtype, shape).unwrap() as usize;
        Spec {
            name,
            dtype,
            shape: shape.to_vec(),
            // Distinct bytes per tensor, so a wrong offset shows up as wrong data.
            data: (0..n).map(|j| (i * 37 + j * 11 + 1) as u8).collect(),
        }
    }

    fn serialize(specs: &[Spec], metadata: Option<HashMap<String, String>>) -> Vec<u8> {
        let views: Vec<_> = specs
            .iter()
            .map(|s| {
                let shape = s.shape.iter().map(|&d| d as usize).collect();
                let view =
                    ::safetensors::tensor::TensorView::new(st_dtype(s.dtype), shape, &s.data)
                        .unwrap();
                (s.name, view)
            })
            .collect();
        ::safetensors::serialize(views, metadata).unwrap()
    }

    /// Parses with both entry points, which must agree.
    fn parse_both(bytes: &[u8]) -> Header {
        let header = parse_header(bytes, HeaderLimits::NONE).unwrap();
        let mut cursor = Cursor::new(bytes);
        let read = read_header(&mut cursor, bytes.len() as u64, HeaderLimits::NONE).unwrap();
        assert_eq!(header, read);
        // read_header consumes the header and nothing after it.
        assert_eq!(cursor.position(), 8 + header.header_len);
        header
    }

    fn check_against(specs: &[Spec], bytes: &[u8], header: &Header) {
        assert_eq!(header.tensors.len(), specs.len());
        let prefix = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!(header.header_len, prefix);
        assert!(
            header
                .tensors
                .windows(2)
                .all(|w| w[0].file_offset <= w[1].file_offset)
        );
        for s in specs {
            let t = header.tensors.iter().find(|t| t.name == s.name).unwrap();
            assert_eq!(t.dtype, s.dtype, "{}", s.name);
            assert_eq!(t.shape, s.shape, "{}", s.name);
            assert_eq!(t.nbytes, s.data.len() as u64, "{}", s.name);
            assert!(t.file_offset >= 8 + header.header_len, "{}", s.name);
            let at = t.file_offset as usize;
            assert_eq!(
                &bytes[at..at + t.nbytes as usize],
                &s.data[..],
                "{}",
                s.name
            );
        }
    }

    #[test]
    fn parses_files_written_by_the_safetensors_crate() {
        let specs = vec![
            spec(0, "model.embed.weight", DType::BF16, &[4, 3]),
            spec(1, "scale", DType::F32, &[]),
            spec(2, "ids", DType::I64, &[2, 1, 3]),
            spec(3, "raw", DType::U8, &[5]),
            spec(4, "q.weight", DType::F8E4M3, &[7]),
            spec(5, "mask", DType::Bool, &[3]),
            spec(6, "empty", DType::F32, &[0, 4]),
        ];
        let metadata = HashMap::from([
            ("format".to_string(), "pt".to_string()),
            ("note".to_string(), "a \"quoted\" value".to_string()),
        ]);
        let bytes = serialize(&specs, Some(metadata.clone()));
        let header = parse_both(&bytes);
        check_against(&specs, &bytes, &header);
        assert_eq!(
            header.metadata,
            metadata.into_iter().collect::<BTreeMap<_, _>>()
        );
        let scalar = header.tensors.iter().find(|t| t.name == "scale").unwrap();
        assert_eq!(scalar.nbytes, 4);
    }

    #[test]
    fn parses_every_dtype_written_by_the_safetensors_crate() {
        let names = [
            "t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8", "t9", "t10", "t11", "t12", "t13",
            "t14",
        ];
        let specs: Vec<_> = DType::ALL
            .into_iter()
            .zip(names)
            .enumerate()
            .map(|(i, (d, name))| spec(i, name, d, &[2, 3]))
            .collect();
        let bytes = serialize(&specs, None);
        let header = parse_both(&bytes);
        check_against(&specs, &bytes, &header);
        assert!(header.metadata.is_empty());
    }

    #[test]
    fn empty_file_from_the_safetensors_crate_is_valid() {
        let bytes = serialize(&[], None);
        let header = parse_both(&bytes);
        assert!(header.tensors.is_empty());
        assert!(header.metadata.is_empty());
    }

    /// A file with this JSON header and `data_len` zero bytes of data.
    fn file(json: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }

    /// The error both entry points give (they must agree), and its message.
    fn fail(bytes: &[u8]) -> (HeaderError, String) {
        fail_within(bytes, HeaderLimits::NONE)
    }

    fn fail_within(bytes: &[u8], limits: HeaderLimits) -> (HeaderError, String) {
        let err = parse_header(bytes, limits).unwrap_err();
        let read = read_header(&mut Cursor::new(bytes), bytes.len() as u64, limits).unwrap_err();
        assert_eq!(err.to_string(), read.to_string());
        let msg = err.to_string();
        (err, msg)
    }

    fn fail_json(json: &str, data_len: usize) -> (HeaderError, String) {
        fail(&file(json, data_len))
    }

    fn assert_contains(msg: &str, parts: &[&str]) {
        for part in parts {
            assert!(msg.contains(part), "{msg:?} lacks {part:?}");
        }
    }

    #[test]
    fn empty_header_is_valid() {
        let header = parse_both(&file("{}", 0));
        assert_eq!(header.header_len, 2);
        assert!(header.tensors.is_empty());
        assert!(header.metadata.is_empty());
        // Writers pad the header with spaces to align the data.
        let padded = parse_both(&file("{}      ", 0));
        assert_eq!(padded.header_len, 8);
    }

    #[test]
    fn metadata_only_header_is_valid() {
        let header = parse_both(&file(r#"{"__metadata__":{"k":"v"}}"#, 0));
        assert!(header.tensors.is_empty());
        assert_eq!(header.metadata.get("k").map(String::as_str), Some("v"));
    }

    #[test]
    fn hand_made_header_gives_absolute_offsets_sorted() {
        let json = r#"{"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},
            "a":{"dtype":"U16","shape":[2],"data_offsets":[0,4],"extra":[1,{"x":null}]},
            "e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}}"#;
        let header = parse_both(&file(json, 8));
        let start = 8 + json.len() as u64;
        let got: Vec<_> = header
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.file_offset, t.nbytes))
            .collect();
        assert_eq!(
            got,
            [("a", start, 4), ("b", start + 4, 4), ("e", start + 8, 0)]
        );
    }

    #[test]
    fn file_shorter_than_length_prefix() {
        let (err, msg) = fail(&[1, 2, 3, 4, 5]);
        assert!(matches!(err, HeaderError::FileTooShort { file_len: 5 }));
        assert_eq!(
            msg,
            "file is 5 bytes, shorter than the 8-byte header length"
        );
        assert!(matches!(
            fail(&[]).0,
            HeaderError::FileTooShort { file_len: 0 }
        ));
    }

    /// A length over the limit or past the end says so without its value: those are the
    /// file's first 8 bytes, whatever the file is (here the text "secret!!").
    #[test]
    fn an_implausible_header_length_is_refused_without_quoting_it() {
        let cases: Vec<Vec<u8>> = vec![
            [&(MAX_HEADER_BYTES + 1).to_le_bytes()[..], b"{}"].concat(),
            [&u64::MAX.to_le_bytes()[..], b"{}"].concat(),
            [&(1u64 << 40).to_le_bytes()[..], b"{}"].concat(),
            [&100u64.to_le_bytes()[..], b"{}"].concat(),
            b"secret!! and the rest of a private file".to_vec(),
        ];
        let mut failures = Vec::new();
        for bytes in &cases {
            let (err, msg) = fail(bytes);
            let prefix = u64::from_le_bytes(bytes[..8].try_into().unwrap());
            if !matches!(err, HeaderError::ImplausibleHeaderLength)
                || msg != "not a safetensors file: the header length is not plausible"
                || msg.contains(&prefix.to_string())
                || msg.contains("secret")
            {
                failures.push(format!("{prefix}: {msg}"));
            }
            // Only the prefix was read: no buffer of that length was filled.
            let mut cursor = Cursor::new(bytes);
            read_header(&mut cursor, bytes.len() as u64, HeaderLimits::NONE).unwrap_err();
            if cursor.position() != 8 {
                failures.push(format!("{prefix}: read {} bytes", cursor.position()));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn read_header_reports_a_stream_shorter_than_file_len() {
        let bytes = file("{}", 0);
        let err = read_header(
            &mut Cursor::new(&bytes[..6]),
            bytes.len() as u64,
            HeaderLimits::NONE,
        )
        .unwrap_err();
        assert!(matches!(err, HeaderError::Io(_)), "{err}");
        assert_contains(&err.to_string(), &["cannot read the header"]);
    }

    #[test]
    fn header_not_utf8() {
        let mut bytes = 4u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
        let (err, msg) = fail(&bytes);
        assert!(matches!(err, HeaderError::InvalidHeader(_)));
        assert_contains(&msg, &["not valid UTF-8", "index 1"]);
    }

    #[test]
    fn header_not_json() {
        for (json, expect) in [
            ("{", "EOF while parsing"),
            ("", "EOF while parsing"),
            ("{\"a\" 1}", "expected `:`"),
            ("{} x", "trailing characters"),
        ] {
            let (err, msg) = fail_json(json, 0);
            assert!(matches!(err, HeaderError::InvalidHeader(_)), "{json}");
            assert_contains(&msg, &["invalid header", expect]);
        }
    }

    #[test]
    fn header_not_an_object() {
        for json in ["[]", "3", "\"x\"", "null"] {
            let (err, msg) = fail_json(json, 0);
            assert!(matches!(err, HeaderError::InvalidHeader(_)), "{json}");
            assert_contains(
                &msg,
                &["invalid type", "a JSON object mapping tensor names"],
            );
        }
    }

    #[test]
    fn tensor_entry_missing_a_field() {
        for (json, field) in [
            (r#"{"w":{"shape":[1],"data_offsets":[0,1]}}"#, "dtype"),
            (r#"{"w":{"dtype":"U8","data_offsets":[0,1]}}"#, "shape"),
            (r#"{"w":{"dtype":"U8","shape":[1]}}"#, "data_offsets"),
        ] {
            let (err, msg) = fail_json(json, 1);
            assert!(matches!(err, HeaderError::InvalidHeader(_)), "{json}");
            assert_contains(&msg, &[&format!("tensor 'w': missing field '{field}'")]);
        }
    }

    #[test]
    fn tensor_entry_with_wrong_json_types() {
        for (json, expect) in [
            (r#"{"w":[1]}"#, "tensor 'w' to be an object"),
            (
                r#"{"w":{"dtype":8,"shape":[1],"data_offsets":[0,1]}}"#,
                "dtype string for tensor 'w'",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":"1","data_offsets":[0,1]}}"#,
                "shape array for tensor 'w'",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#,
                "a negative integer, expected non-negative integers in shape",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}}"#,
                "shape of tensor 'w'",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}}"#,
                "invalid length 1",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}"#,
                "more than 2 elements",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,"1"]}}"#,
                "data_offsets of tensor 'w'",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":{}}}"#,
                "data_offsets [begin, end] for tensor 'w'",
            ),
            (
                r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551616]}}"#,
                "data_offsets of tensor 'w'",
            ),
        ] {
            let (err, msg) = fail_json(json, 1);
            assert!(matches!(err, HeaderError::InvalidHeader(_)), "{json}");
            assert_contains(&msg, &[expect, "tensor 'w'"]);
        }
    }

    /// A value of the wrong type is named by its kind, never quoted, wherever it sits.
    #[test]
    fn type_errors_do_not_quote_the_value() {
        let cases = [
            r#""hunter2""#,
            r#"{"w":"hunter2"}"#,
            r#"{"w":{"dtype":"U8","shape":"hunter2","data_offsets":[0,1]}}"#,
            r#"{"w":{"dtype":"U8","shape":["hunter2"],"data_offsets":[0,1]}}"#,
            r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":"hunter2"}}"#,
            r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,"hunter2"]}}"#,
            r#"{"w":{"dtype":1234567,"shape":[1],"data_offsets":[0,1]}}"#,
            r#"{"w":{"dtype":"U8","shape":[-1234567],"data_offsets":[0,1]}}"#,
            r#"{"w":{"dtype":"U8","shape":[1234.567],"data_offsets":[0,1]}}"#,
            r#"{"w":{"dtype":"hunter2","shape":[1],"data_offsets":[0,1]}}"#,
            r#"{"__metadata__":"hunter2"}"#,
            r#"{"__metadata__":{"hunter2":1234567}}"#,
            r#"{"__metadata__":{"hunter2":"a","hunter2":"b"}}"#,
        ];
        let quoted: Vec<String> = cases
            .iter()
            .map(|json| fail_json(json, 1).1)
            .filter(|msg| msg.contains("hunter2") || msg.contains("1234"))
            .collect();
        assert!(quoted.is_empty(), "{quoted:#?}");
    }

    #[test]
    fn tensor_entry_with_a_duplicate_field() {
        let json = r#"{"w":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}}"#;
        let (err, msg) = fail_json(json, 1);
        assert!(matches!(err, HeaderError::InvalidHeader(_)));
        assert_contains(&msg, &["tensor 'w': duplicate field 'dtype'"]);
    }

    #[test]
    fn metadata_must_be_an_object_of_strings() {
        for (json, expect) in [
            (
                r#"{"__metadata__":{"a":1}}"#,
                "an integer, expected string values in __metadata__",
            ),
            (
                r#"{"__metadata__":{"a":{"b":"c"}}}"#,
                "map, expected string values in __metadata__",
            ),
            (r#"{"__metadata__":["a"]}"#, "__metadata__ to be an object"),
            (r#"{"__metadata__":"a"}"#, "__metadata__ to be an object"),
            (
                r#"{"__metadata__":{"a":"1","a":"2"}}"#,
                "__metadata__: a key appears twice",
            ),
            (
                r#"{"__metadata__":{},"__metadata__":{}}"#,
                "duplicate key '__metadata__'",
            ),
        ] {
            let (err, msg) = fail_json(json, 0);
            assert!(matches!(err, HeaderError::InvalidHeader(_)), "{json}");
            assert_contains(&msg, &[expect]);
        }
    }

    #[test]
    fn unknown_dtype() {
        let (err, msg) = fail_json(
            r#"{"x":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#,
            1,
        );
        assert!(matches!(err, HeaderError::UnknownDType { .. }));
        assert_eq!(
            msg,
            "tensor 'x': unknown dtype (not one of BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, \
             F16, BF16, I32, U32, F32, F64, I64, U64)"
        );
        // Names are case-sensitive, and dtypes outside the 15 are not loaded.
        for dtype in ["bf16", "F8_E4M3FNUZ", "C64"] {
            let json = format!(r#"{{"x":{{"dtype":"{dtype}","shape":[1],"data_offsets":[0,1]}}}}"#);
            assert!(matches!(
                fail_json(&json, 1).0,
                HeaderError::UnknownDType { .. }
            ));
        }
    }

    #[test]
    fn data_offsets_end_before_they_begin() {
        let (err, msg) = fail_json(
            r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[8,4]}}"#,
            8,
        );
        assert!(matches!(
            err,
            HeaderError::OffsetsReversed {
                begin: 8,
                end: 4,
                ..
            }
        ));
        assert_eq!(msg, "tensor 'x': data_offsets [8, 4] end before they begin");
    }

    #[test]
    fn data_offsets_beyond_data_section() {
        let (err, msg) = fail_json(
            r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#,
            8,
        );
        assert!(matches!(
            err,
            HeaderError::OffsetsPastData {
                end: 12,
                data_len: 8,
                ..
            }
        ));
        assert_eq!(
            msg,
            "tensor 'x': data_offsets end 12 is beyond the data section of 8 bytes"
        );
    }

    #[test]
    fn shape_does_not_match_data_offsets() {
        let (err, msg) = fail_json(
            r#"{"x":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}}"#,
            10,
        );
        assert!(matches!(
            err,
            HeaderError::SizeMismatch {
                nbytes: 12,
                span: 10,
                dtype: DType::BF16,
                ..
            }
        ));
        assert_eq!(
            msg,
            "tensor 'x': shape [2, 3] of BF16 is 12 bytes but data_offsets span 10 bytes"
        );
    }

    #[test]
    fn shape_size_overflows() {
        let json = r#"{"x":{"dtype":"BF16","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#;
        let (err, msg) = fail_json(json, 0);
        assert!(matches!(
            err,
            HeaderError::ShapeOverflow {
                dtype: DType::BF16,
                ..
            }
        ));
        assert_eq!(
            msg,
            "tensor 'x': shape [4294967296, 4294967296] of BF16 is more than 18446744073709551615 bytes"
        );
        // A zero dimension does not excuse the others.
        let json =
            r#"{"x":{"dtype":"U8","shape":[0,18446744073709551615,2],"data_offsets":[0,0]}}"#;
        assert!(matches!(
            fail_json(json, 0).0,
            HeaderError::ShapeOverflow { .. }
        ));
    }

    #[test]
    fn overlapping_tensors() {
        let json = r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},
                       "b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#;
        let (err, msg) = fail_json(json, 12);
        assert!(matches!(
            err,
            HeaderError::Overlap {
                first_range: [0, 8],
                second_range: [4, 12],
                ..
            }
        ));
        assert_eq!(msg, "tensors 'a' and 'b' overlap: [0, 8] and [4, 12]");
        // Two tensors on the same bytes are an overlap too.
        let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                       "b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}}"#;
        let (_, msg) = fail_json(json, 4);
        assert_eq!(msg, "tensors 'a' and 'b' overlap: [0, 4] and [0, 4]");
    }

    #[test]
    fn zero_length_tensors_overlap_nothing() {
        let json = r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},
                       "z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},
                       "y":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}}"#;
        let header = parse_both(&file(json, 8));
        assert_eq!(header.tensors.len(), 3);
    }

    #[test]
    fn gap_between_tensors() {
        let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                       "b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}}"#;
        let (err, msg) = fail_json(json, 12);
        assert!(matches!(
            err,
            HeaderError::Uncovered { begin: 4, end: 8, after: Some(ref a) } if a == "a"
        ));
        assert_contains(
            &msg,
            &["data section bytes [4, 8) after tensor 'a' are not covered by any tensor"],
        );
    }

    #[test]
    fn gap_before_first_tensor() {
        let (err, msg) = fail_json(
            r#"{"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
            8,
        );
        assert!(matches!(
            err,
            HeaderError::Uncovered {
                begin: 0,
                end: 4,
                after: None
            }
        ));
        assert_contains(&msg, &["data section bytes [0, 4) are not covered"]);
    }

    #[test]
    fn trailing_bytes_after_last_tensor() {
        let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                       "b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#;
        let (err, msg) = fail_json(json, 12);
        assert!(matches!(
            err,
            HeaderError::Uncovered { begin: 8, end: 12, after: Some(ref b) } if b == "b"
        ));
        assert_contains(&msg, &["[8, 12) after tensor 'b' are not covered"]);
        // With no tensors at all, the whole data section is uncovered.
        let (err, _) = fail_json("{}", 4);
        assert!(matches!(
            err,
            HeaderError::Uncovered {
                begin: 0,
                end: 4,
                after: None
            }
        ));
    }

    #[test]
    fn duplicate_tensor_name() {
        let json = r#"{"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                       "x":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#;
        let (err, msg) = fail_json(json, 8);
        assert!(matches!(err, HeaderError::DuplicateTensor { ref name } if name == "x"));
        assert_eq!(msg, "duplicate tensor name 'x'");
    }

    /// `n` empty tensors named by their index.
    fn empty_tensors(n: usize) -> String {
        let entries: Vec<String> = (0..n)
            .map(|i| format!(r#""{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}"#))
            .collect();
        format!("{{{}}}", entries.join(","))
    }

    #[test]
    fn too_many_tensors() {
        let (err, msg) = fail_json(&empty_tensors(MAX_TENSORS + 1), 0);
        assert!(matches!(
            err,
            HeaderError::TooManyTensors { limit: MAX_TENSORS }
        ));
        assert_contains(&msg, &["1000000"]);
    }

    /// The limits given are the daemon's: a header may list `max_tensors` tensors and no more,
    /// and a name may be `max_name_bytes` long and no longer; the name is not quoted.
    #[test]
    fn the_limits_given_hold_tensor_counts_and_names() {
        let limits = HeaderLimits {
            max_tensors: 3,
            max_name_bytes: 16,
        };
        let parse = |json: &str| parse_header(&file(json, 0), limits).map(|h| h.tensors.len());
        assert_eq!(parse(&empty_tensors(3)).unwrap(), 3);
        let (_, msg) = fail_within(&file(&empty_tensors(4), 0), limits);
        assert_eq!(
            msg,
            "the header lists more than 3 tensors: limits.max_tensors_per_model = 3"
        );
        let name = |n: usize| {
            format!(
                r#"{{"a":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}},"{}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}}}"#,
                "x".repeat(n)
            )
        };
        assert_eq!(parse(&name(16)).unwrap(), 2);
        let (err, msg) = fail_within(&file(&name(17), 0), limits);
        assert!(matches!(
            err,
            HeaderError::NameTooLong {
                index: 1,
                len: 17,
                limit: 16
            }
        ));
        assert_eq!(
            msg,
            "tensor 1 of the header has a name of 17 bytes: limits.max_name_bytes = 16"
        );
        assert!(!msg.contains("xxx"), "the name is not quoted: {msg}");
    }

    #[test]
    fn dtype_names_round_trip() {
        let expected = [
            "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32",
            "F32", "F64", "I64", "U64",
        ];
        let names: Vec<_> = DType::ALL.iter().map(|d| d.name()).collect();
        assert_eq!(names, expected);
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert_eq!(d.to_string(), d.name());
            assert_eq!(format!("{:?}", st_dtype(d)), d.name());
        }
        assert_eq!(DType::from_name("bf16"), None);
        assert_eq!(DType::from_name(""), None);
    }

    #[test]
    fn dtype_sizes() {
        for d in DType::ALL {
            assert_eq!(d.size() * 8, st_dtype(d).bitsize() as u64, "{d}");
        }
        assert_eq!(DType::F8E4M3.size(), 1);
        assert_eq!(DType::F8E5M2.size(), 1);
        assert_eq!(DType::Bool.size(), 1);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::F64.size(), 8);
    }

    #[test]
    fn tensor_nbytes_cases() {
        assert_eq!(tensor_nbytes(DType::F32, &[]), Some(4));
        assert_eq!(tensor_nbytes(DType::BF16, &[2, 3]), Some(12));
        assert_eq!(tensor_nbytes(DType::I64, &[3, 0, 5]), Some(0));
        assert_eq!(tensor_nbytes(DType::U8, &[u64::MAX]), Some(u64::MAX));
        assert_eq!(tensor_nbytes(DType::BF16, &[u64::MAX]), None);
        assert_eq!(tensor_nbytes(DType::U8, &[1 << 32, 1 << 32]), None);
        assert_eq!(tensor_nbytes(DType::U8, &[0, 1 << 32, 1 << 32]), None);
    }
}
