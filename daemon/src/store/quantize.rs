//! 8-bit weights, the numerical core: the formats the daemon makes itself ([`Target`]:
//! `fp8_e4m3_block64`, `fp8_e4m3_row`, `int8_row`; pure: no I/O, no store state).
//!
//! A tensor of rank ≥ 2 is viewed as a matrix, rows = `shape[0]`, cols = the product of the
//! rest (a Conv2d weight `[out, in, kh, kw]` is `[out, in·kh·kw]`). Each row is cut into blocks:
//! of 64 consecutive elements in `fp8_e4m3_block64` (one block per row when cols is not a
//! multiple of 64), one block per row in `fp8_e4m3_row` and `int8_row`. Per block, with qmax
//! 448 (e4m3fn) or 127 (int8):
//!
//! ```text
//! scale = amax(|w_block|) / qmax              fp32; 1 when that is 0 (all zeros, or underflow)
//! q     = e4m3fn(clamp(w / scale, ±448))       fp32 division, round to nearest even
//! q     = int8(round(clamp(w / scale, ±127)))  the same, rounded half to even (int8_row)
//! w_hat = (q.to(float32) * scale).to(compute dtype)      the documented dequantization
//! ```
//!
//! `q` is stored as e4m3fn (or int8) bytes in the weight's own shape, the scales as
//! little-endian fp32 of shape `[rows, cols/64]` (or `[rows, 1]`). The arithmetic is torch's
//! reference step for step (`w.float()`, `amax`, `/ qmax`, `w / scale`, `clamp`, `round`,
//! `.to(torch.float8_e4m3fn)` or `.to(torch.int8)`), and the results equal it bit for bit
//! (`daemon/e2e/tests/quantize.rs` against a fixture torch wrote). The division stays a
//! division: `w * (1 / scale)` rounds twice and differs from torch in the last bit of some
//! quotients, which moves some of them across a rounding boundary of the 8-bit grid.

use std::fmt;
use std::num::NonZeroUsize;
use std::str::FromStr;
use std::sync::Mutex;

use super::safetensors::DType;

/// Elements per scale along a row (when the row length is a multiple of it).
pub const BLOCK: usize = 64;
/// Largest finite float8_e4m3fn value: the scale maps each block's amax onto it.
pub const E4M3_MAX: f32 = 448.0;
/// The int8 grid's bound in `int8_row` (symmetric: -128 is never used).
pub const INT8_MAX: f32 = 127.0;
/// The e4m3fn code torch gives NaN (and, unclamped, magnitudes above 464).
pub const E4M3_NAN: u8 = 0x7F;

/// How a model's weights are held and streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Quantization {
    /// As stored in the source (bf16, f16, f32, …).
    #[default]
    None,
    /// float8_e4m3fn with one fp32 scale per 64 inputs of a row (per row when the width is not
    /// a multiple of 64).
    Fp8E4m3Block64,
    /// float8_e4m3fn with one fp32 scale per row (scale shape `[rows, 1]`): the rows 8-bit
    /// compute multiplies as they are.
    Fp8E4m3Row,
    /// int8 with one fp32 scale per row (symmetric, amax / 127, rounded half to even).
    Int8Row,
    /// Read as published: musubi-tuner `--fp8_scaled` weights (see [`super::prequantized`]).
    Fp8ScaledMusubi,
    /// Read as published: ComfyUI scaled-fp8 weights (see [`super::prequantized`]).
    Fp8ScaledComfy,
    /// Uploaded as torchao made it: a `Float8Tensor` quantized per row, e4m3fn data with one
    /// fp32 scale per row (see [`super::prequantized::torchao_layout`]).
    TorchaoFloat8Rowwise,
    /// Uploaded as torchao made it: an `Int8Tensor` quantized per row (symmetric), int8 data
    /// with one fp32 scale per row.
    TorchaoInt8Rowwise,
}

impl Quantization {
    /// The spellings [`Quantization::parse`] accepts, for messages and help texts.
    pub const ACCEPTED: &str =
        "none, fp8_e4m3_block64, fp8 (an alias of fp8_e4m3_block64), fp8_e4m3_row, int8_row";

    /// Parses the `quantization` field of a config or request.
    pub fn parse(value: &str) -> Result<Quantization, QuantizeError> {
        match value {
            "none" => Ok(Quantization::None),
            "fp8_e4m3_block64" | "fp8" => Ok(Quantization::Fp8E4m3Block64),
            "fp8_e4m3_row" => Ok(Quantization::Fp8E4m3Row),
            "int8_row" => Ok(Quantization::Int8Row),
            other => Err(QuantizeError::UnknownQuantization {
                value: other.chars().take(64).collect(),
            }),
        }
    }

    /// The canonical spelling (what `parse` accepts and `status` shows).
    pub fn name(self) -> &'static str {
        match self {
            Quantization::None => "none",
            Quantization::Fp8E4m3Block64 => "fp8_e4m3_block64",
            Quantization::Fp8E4m3Row => "fp8_e4m3_row",
            Quantization::Int8Row => "int8_row",
            Quantization::Fp8ScaledMusubi => "fp8_scaled_musubi",
            Quantization::Fp8ScaledComfy => "fp8_scaled_comfy",
            Quantization::TorchaoFloat8Rowwise => "torchao_float8_rowwise",
            Quantization::TorchaoInt8Rowwise => "torchao_int8_rowwise",
        }
    }

    /// Whether a client may ask for it: in LoadModel (the daemon quantizes), or per tensor in
    /// BeginUpload (quantized at commit, or written pre-quantized). The others describe files
    /// read as published.
    pub fn requestable(self) -> bool {
        !matches!(
            self,
            Quantization::Fp8ScaledMusubi | Quantization::Fp8ScaledComfy
        )
    }

    /// Whether it is only ever written by its client, pre-quantized (never made by the daemon,
    /// never read from files).
    pub fn upload_only(self) -> bool {
        matches!(
            self,
            Quantization::TorchaoFloat8Rowwise | Quantization::TorchaoInt8Rowwise
        )
    }
}

/// A format the daemon quantizes into itself: while loading (LoadModel), or at commit (an
/// upload's float tensor declared in it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Fp8Block64,
    Fp8Row,
    Int8Row,
}

impl Target {
    /// The target of `quantization`, if the daemon makes it.
    pub fn of(quantization: Quantization) -> Option<Target> {
        match quantization {
            Quantization::Fp8E4m3Block64 => Some(Target::Fp8Block64),
            Quantization::Fp8E4m3Row => Some(Target::Fp8Row),
            Quantization::Int8Row => Some(Target::Int8Row),
            _ => None,
        }
    }

    pub fn quantization(self) -> Quantization {
        match self {
            Target::Fp8Block64 => Quantization::Fp8E4m3Block64,
            Target::Fp8Row => Quantization::Fp8E4m3Row,
            Target::Int8Row => Quantization::Int8Row,
        }
    }

    pub fn name(self) -> &'static str {
        self.quantization().name()
    }

    /// The dtype of the quantized data (one byte per element).
    pub fn data_dtype(self) -> DType {
        match self {
            Target::Fp8Block64 | Target::Fp8Row => DType::F8E4M3,
            Target::Int8Row => DType::I8,
        }
    }

    /// Elements per scale in a row of `cols`.
    fn block(self, cols: usize) -> usize {
        match self {
            Target::Fp8Block64 if cols.is_multiple_of(BLOCK) => BLOCK,
            _ => cols,
        }
    }
}

impl FromStr for Quantization {
    type Err = QuantizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Quantization::parse(s)
    }
}

impl fmt::Display for Quantization {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A non-finite weight, as error messages spell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonFinite {
    NaN,
    PosInf,
    NegInf,
}

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NonFinite::NaN => "NaN",
            NonFinite::PosInf => "+inf",
            NonFinite::NegInf => "-inf",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantizeError {
    /// The value is cut to 64 characters (it may come from a client).
    #[error(
        "quantization {value:?} is not supported: the accepted values are {accepted}",
        accepted = Quantization::ACCEPTED
    )]
    UnknownQuantization { value: String },
    #[error("tensor '{name}' has rank {rank}: {format} quantizes only rank ≥ 2 weights")]
    Rank {
        name: String,
        rank: usize,
        format: &'static str,
    },
    #[error("tensor '{name}' has dtype {dtype}: only BF16, F16 and F32 can be quantized")]
    DType { name: String, dtype: DType },
    #[error("tensor '{name}': shape {shape:?} has more elements than this machine can address")]
    ShapeOverflow { name: String, shape: Vec<u64> },
    #[error("tensor '{name}' has {actual} bytes, but {dtype} of shape {shape:?} needs {expected}")]
    Size {
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        expected: usize,
        actual: usize,
    },
    #[error("tensor '{name}': the {what} output has {actual} bytes, {expected} are needed")]
    OutputSize {
        name: String,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A pre-quantized file's weight or scale that breaks its format's rules (the message names
    /// the tensor and the rule).
    #[error("{0}")]
    Prequantized(String),
    #[error("tensor '{name}': {value} at index {index}: cannot quantize")]
    NonFinite {
        name: String,
        value: NonFinite,
        index: u64,
    },
}

/// How a weight's shape maps to blocks and scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    pub target: Target,
    pub rows: usize,
    pub cols: usize,
    /// Elements per scale: in `fp8_e4m3_block64` 64, or `cols` when `cols` is not a multiple
    /// of 64; in the row formats `cols`.
    pub block: usize,
}

impl BlockLayout {
    /// The layout in `target` of a weight of `shape`: rank ≥ 2, rows = `shape[0]`, cols = the
    /// rest.
    pub fn of(target: Target, name: &str, shape: &[u64]) -> Result<BlockLayout, QuantizeError> {
        if shape.len() < 2 {
            return Err(QuantizeError::Rank {
                name: name.to_owned(),
                rank: shape.len(),
                format: target.name(),
            });
        }
        let overflow = || QuantizeError::ShapeOverflow {
            name: name.to_owned(),
            shape: shape.to_vec(),
        };
        let dim = |d: u64| usize::try_from(d).map_err(|_| overflow());
        let rows = dim(shape[0])?;
        let cols = shape[1..].iter().try_fold(1usize, |acc, &d| {
            acc.checked_mul(dim(d)?).ok_or_else(overflow)
        })?;
        // Four bytes of input per element at most: the input must fit in memory too.
        rows.checked_mul(cols)
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(overflow)?;
        Ok(BlockLayout {
            target,
            rows,
            cols,
            block: target.block(cols),
        })
    }

    pub fn elements(&self) -> usize {
        self.rows * self.cols
    }

    pub fn blocks_per_row(&self) -> usize {
        // A width of 0 has no blocks in any format (`block` is 0 in the row formats).
        self.cols.checked_div(self.block).unwrap_or(0)
    }

    /// The shape of the scales: `[rows, cols / 64]`, or `[rows, 1]`.
    pub fn scale_shape(&self) -> [u64; 2] {
        [self.rows as u64, self.blocks_per_row() as u64]
    }

    /// Bytes of the scales (little-endian fp32).
    pub fn scale_bytes(&self) -> usize {
        self.rows * self.blocks_per_row() * 4
    }
}

/// Where a quantized weight's data and scales sit in its one contiguous slice of the store:
/// `[data: rows·cols bytes][zero padding to 16][scales: fp32 of scale_shape]`. One slice per
/// weight, so that staging, copies and placements treat it like any other tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredLayout {
    pub block: BlockLayout,
    /// Bytes of e4m3fn or int8 data (one per element).
    pub data_bytes: u64,
    /// The scales' byte offset from the slice's start: the data rounded up to [`SCALE_ALIGN`].
    pub scale_offset: u64,
    /// The whole slice: `scale_offset` + the scales.
    pub nbytes: u64,
}

/// Alignment of the scales within a quantized weight's slice.
pub const SCALE_ALIGN: u64 = 16;

impl StoredLayout {
    /// The slice layout in `target` of a weight of `shape` (rank ≥ 2).
    pub fn of(target: Target, name: &str, shape: &[u64]) -> Result<StoredLayout, QuantizeError> {
        let block = BlockLayout::of(target, name, shape)?;
        // `BlockLayout::of` checked that 4 bytes per element fit: these cannot overflow.
        let data_bytes = block.elements() as u64;
        let scale_offset = data_bytes.div_ceil(SCALE_ALIGN) * SCALE_ALIGN;
        Ok(StoredLayout {
            block,
            data_bytes,
            scale_offset,
            nbytes: scale_offset + block.scale_bytes() as u64,
        })
    }

    /// Splits a slice of `nbytes` into (data, padding, scales).
    pub fn split_mut<'a>(&self, slice: &'a mut [u8]) -> (&'a mut [u8], &'a mut [u8], &'a mut [u8]) {
        let (data, rest) = slice.split_at_mut(self.data_bytes as usize);
        let (pad, scales) = rest.split_at_mut((self.scale_offset - self.data_bytes) as usize);
        (data, pad, scales)
    }
}

impl Quantized {
    /// The weight as the store holds it: data, zero padding, scales (see [`StoredLayout`]).
    pub fn to_stored(&self) -> Vec<u8> {
        let offset = self.data.len().div_ceil(SCALE_ALIGN as usize) * SCALE_ALIGN as usize;
        let mut out = vec![0u8; offset + self.scales.len()];
        out[..self.data.len()].copy_from_slice(&self.data);
        out[offset..].copy_from_slice(&self.scales);
        out
    }
}

/// Whether a load with `quantization` quantizes this tensor: a weight (the name ends in
/// ".weight") of rank ≥ 2 in BF16, F16 or F32, in a format the daemon makes. The others keep
/// their dtype and bytes.
pub fn quantizes_on_load(
    quantization: Quantization,
    name: &str,
    dtype: DType,
    rank: usize,
) -> bool {
    Target::of(quantization).is_some()
        && name.ends_with(".weight")
        && rank >= 2
        && Input::of(dtype).is_some()
}

/// The first non-finite fp32 in little-endian `scales` (an uploaded weight's), as (index, kind).
pub fn first_non_finite_scale(scales: &[u8]) -> Option<(u64, NonFinite)> {
    scales
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("chunks of 4")))
        .position(|x| !x.is_finite())
        .map(|i| {
            let x = f32::from_le_bytes(scales[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
            (i as u64, classify(x))
        })
}

/// One weight to quantize into `target`: its bytes as in safetensors (little-endian,
/// row-major).
#[derive(Debug, Clone, Copy)]
pub struct TensorIn<'a> {
    pub target: Target,
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
}

/// Where a weight's quantized form goes: `data` holds one byte per element, `scales`
/// [`BlockLayout::scale_bytes`] bytes.
#[derive(Debug)]
pub struct TensorOut<'a> {
    pub data: &'a mut [u8],
    pub scales: &'a mut [u8],
}

/// A quantized weight: e4m3fn (or int8) bytes in the weight's shape, fp32 scales
/// (little-endian).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantized {
    pub data: Vec<u8>,
    pub scales: Vec<u8>,
    pub scale_shape: [u64; 2],
}

/// Quantizes one weight into `fp8_e4m3_block64` on the calling thread.
pub fn quantize(
    name: &str,
    dtype: DType,
    shape: &[u64],
    bytes: &[u8],
) -> Result<Quantized, QuantizeError> {
    quantize_as(Target::Fp8Block64, name, dtype, shape, bytes)
}

/// Quantizes one weight into `target` on the calling thread.
pub fn quantize_as(
    target: Target,
    name: &str,
    dtype: DType,
    shape: &[u64],
    bytes: &[u8],
) -> Result<Quantized, QuantizeError> {
    let tensor = TensorIn {
        target,
        name,
        dtype,
        shape,
        bytes,
    };
    let mut out = quantize_all(&[tensor], NonZeroUsize::MIN)?;
    Ok(out.pop().expect("one tensor in, one out"))
}

/// Quantizes many weights on up to `threads` threads, splitting large weights by rows, so
/// one big tensor uses every thread too. The result does not depend on `threads`.
///
/// Errors: every tensor's shape, dtype and size are checked before any work, and the first
/// bad one in input order is reported; then the first non-finite weight of the first tensor
/// (in input order) that has one.
pub fn quantize_all(
    tensors: &[TensorIn<'_>],
    threads: NonZeroUsize,
) -> Result<Vec<Quantized>, QuantizeError> {
    let layouts = tensors.iter().map(check).collect::<Result<Vec<_>, _>>()?;
    let mut out: Vec<Quantized> = layouts
        .iter()
        .map(|l| Quantized {
            data: vec![0; l.elements()],
            scales: vec![0; l.scale_bytes()],
            scale_shape: l.scale_shape(),
        })
        .collect();
    let work = tensors
        .iter()
        .zip(&mut out)
        .map(|(t, q)| {
            let out = TensorOut {
                data: &mut q.data,
                scales: &mut q.scales,
            };
            (*t, out)
        })
        .collect();
    quantize_all_into(work, threads)?;
    Ok(out)
}

/// [`quantize_all`] into caller-provided memory (an arena, say). Errors as there, plus
/// [`QuantizeError::OutputSize`] when an output is not exactly the size the weight needs.
pub fn quantize_all_into(
    work: Vec<(TensorIn<'_>, TensorOut<'_>)>,
    threads: NonZeroUsize,
) -> Result<(), QuantizeError> {
    let mut jobs = Vec::new();
    let mut names = Vec::with_capacity(work.len());
    for (index, (t, out)) in work.into_iter().enumerate() {
        let layout = check(&t)?;
        for (what, expected, actual) in [
            ("data", layout.elements(), out.data.len()),
            ("scales", layout.scale_bytes(), out.scales.len()),
        ] {
            if expected != actual {
                return Err(QuantizeError::OutputSize {
                    name: t.name.to_owned(),
                    what,
                    expected,
                    actual,
                });
            }
        }
        split(index, &t, layout, out, &mut jobs);
        names.push(t.name);
    }
    let first_bad = run_jobs(jobs, threads);
    match first_bad {
        None => Ok(()),
        Some((tensor, index, value)) => Err(QuantizeError::NonFinite {
            name: names[tensor].to_owned(),
            value,
            index,
        }),
    }
}

/// The layout of a weight, after checking its dtype and byte length.
fn check(t: &TensorIn<'_>) -> Result<BlockLayout, QuantizeError> {
    let layout = BlockLayout::of(t.target, t.name, t.shape)?;
    if Input::of(t.dtype).is_none() {
        return Err(QuantizeError::DType {
            name: t.name.to_owned(),
            dtype: t.dtype,
        });
    }
    // Cannot overflow: `of` checked elements × 4.
    let expected = layout.elements() * t.dtype.size() as usize;
    if t.bytes.len() != expected {
        return Err(QuantizeError::Size {
            name: t.name.to_owned(),
            dtype: t.dtype,
            shape: t.shape.to_vec(),
            expected,
            actual: t.bytes.len(),
        });
    }
    Ok(layout)
}

/// Elements of input per job: large enough that taking a job costs nothing next to running
/// it, small enough that a few large tensors still spread over every thread.
const JOB_ELEMENTS: usize = 1 << 18;

/// A run of whole blocks of one tensor.
struct Job<'a> {
    tensor: usize,
    /// Index in the tensor of the job's first element (for error messages).
    first: u64,
    target: Target,
    input: Input,
    block: usize,
    src: &'a [u8],
    data: &'a mut [u8],
    scales: &'a mut [u8],
}

fn split<'a>(
    tensor: usize,
    t: &TensorIn<'a>,
    layout: BlockLayout,
    out: TensorOut<'a>,
    jobs: &mut Vec<Job<'a>>,
) {
    let input = Input::of(t.dtype).expect("checked");
    let blocks = layout.rows * layout.blocks_per_row();
    if blocks == 0 {
        return;
    }
    let per_job = (JOB_ELEMENTS / layout.block).max(1);
    let elems = per_job * layout.block;
    let src = t.bytes.chunks(elems * input.size());
    let data = out.data.chunks_mut(elems);
    let scales = out.scales.chunks_mut(per_job * 4);
    for (i, ((src, data), scales)) in src.zip(data).zip(scales).enumerate() {
        jobs.push(Job {
            tensor,
            first: (i * elems) as u64,
            target: layout.target,
            input,
            block: layout.block,
            src,
            data,
            scales,
        });
    }
}

/// Runs the jobs on up to `threads` threads; returns the first non-finite weight (tensor,
/// index, kind) in input order, if any. Jobs of tensors after one known to be bad are skipped,
/// those of earlier tensors still run, so the answer does not depend on scheduling.
fn run_jobs(jobs: Vec<Job<'_>>, threads: NonZeroUsize) -> Option<(usize, u64, NonFinite)> {
    let threads = threads.get().min(jobs.len());
    let queue = Mutex::new(jobs.into_iter());
    let first_bad: Mutex<Option<(usize, u64, NonFinite)>> = Mutex::new(None);
    let worker = || {
        let mut scratch = Vec::new();
        loop {
            // A panic elsewhere leaves the iterator and the Option usable.
            let job = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some(job) = job else { break };
            let lock = || first_bad.lock().unwrap_or_else(|p| p.into_inner());
            if lock().is_some_and(|(t, _, _)| t < job.tensor) {
                continue;
            }
            let tensor = job.tensor;
            if let Err((index, value)) = job.run(&mut scratch) {
                let mut bad = lock();
                if bad.is_none_or(|(t, i, _)| (tensor, index) < (t, i)) {
                    *bad = Some((tensor, index, value));
                }
            }
        }
    };
    if threads <= 1 {
        worker();
    } else {
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(worker);
            }
        });
    }
    first_bad.into_inner().unwrap_or_else(|p| p.into_inner())
}

impl Job<'_> {
    fn run(self, scratch: &mut Vec<f32>) -> Result<(), (u64, NonFinite)> {
        match (self.target, self.input) {
            (Target::Int8Row, Input::BF16) => self.run_as(scratch, bf16_to_f32, Int8),
            (Target::Int8Row, Input::F16) => self.run_as(scratch, f16_to_f32, Int8),
            (Target::Int8Row, Input::F32) => self.run_as(scratch, f32::from_le_bytes, Int8),
            (_, Input::BF16) => self.run_as(scratch, bf16_to_f32, E4m3),
            (_, Input::F16) => self.run_as(scratch, f16_to_f32, E4m3),
            (_, Input::F32) => self.run_as(scratch, f32::from_le_bytes, E4m3),
        }
    }

    /// The loop over blocks, for one input type and one grid. Blocks of 64 (the common case)
    /// get chunks of a constant size and a fixed array, so that the compiler vectorizes without
    /// remainders.
    #[inline(always)]
    fn run_as<const N: usize>(
        self,
        scratch: &mut Vec<f32>,
        widen: impl Fn([u8; N]) -> f32 + Copy,
        grid: impl Grid,
    ) -> Result<(), (u64, NonFinite)> {
        let (first, block) = (self.first, self.block);
        let fail = |i: usize, w: &[f32], at: usize| {
            let index = first + (i * block + at) as u64;
            (index, classify(w[at]))
        };
        let scales = self.scales.chunks_exact_mut(4);
        if block == BLOCK {
            let blocks = self.src.chunks_exact(BLOCK * N);
            let data = self.data.chunks_exact_mut(BLOCK);
            for (i, ((src, q), scale)) in blocks.zip(data).zip(scales).enumerate() {
                let mut w = [0f32; BLOCK];
                widen_into(src, &mut w, widen);
                let s = quantize_block(&w, q, grid).map_err(|at| fail(i, &w, at))?;
                scale.copy_from_slice(&s.to_le_bytes());
            }
        } else {
            scratch.clear();
            scratch.resize(block, 0.0);
            let blocks = self.src.chunks_exact(block * N);
            let data = self.data.chunks_exact_mut(block);
            for (i, ((src, q), scale)) in blocks.zip(data).zip(scales).enumerate() {
                widen_into(src, scratch, widen);
                let s = quantize_block(scratch, q, grid).map_err(|at| fail(i, scratch, at))?;
                scale.copy_from_slice(&s.to_le_bytes());
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    BF16,
    F16,
    F32,
}

impl Input {
    fn of(dtype: DType) -> Option<Input> {
        match dtype {
            DType::BF16 => Some(Input::BF16),
            DType::F16 => Some(Input::F16),
            DType::F32 => Some(Input::F32),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Input::BF16 | Input::F16 => 2,
            Input::F32 => 4,
        }
    }
}

/// Decodes one block into `out` as fp32 (exact for every input dtype: `w.float()`).
#[inline(always)]
fn widen_into<const N: usize>(src: &[u8], out: &mut [f32], f: impl Fn([u8; N]) -> f32) {
    for (x, c) in out.iter_mut().zip(src.chunks_exact(N)) {
        *x = f(c.try_into().expect("chunks of N"));
    }
}

#[inline(always)]
pub(crate) fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
}

/// IEEE half to single, exact. Shifting the 15 magnitude bits into place gives an f32 whose
/// value is the half's times 2^-112 for normals and subnormals alike (the exponent fields have
/// biases 127 and 15; a half subnormal becomes an f32 subnormal), so one exact multiplication by
/// 2^112 finishes both; infinities and NaNs (exponent 31) are rebuilt with the f32 exponent 255.
#[inline(always)]
pub(crate) fn f16_to_f32(b: [u8; 2]) -> f32 {
    let h = u32::from(u16::from_le_bytes(b));
    let sign = (h & 0x8000) << 16;
    let mag = (h & 0x7FFF) << 13;
    let finite = (f32::from_bits(mag) * f32::from_bits((127 + 112) << 23)).to_bits();
    let special = 0x7F80_0000 | (mag & 0x007F_FFFF);
    f32::from_bits(
        sign | if h & 0x7C00 == 0x7C00 {
            special
        } else {
            finite
        },
    )
}

fn classify(x: f32) -> NonFinite {
    if x.is_nan() {
        NonFinite::NaN
    } else if x > 0.0 {
        NonFinite::PosInf
    } else {
        NonFinite::NegInf
    }
}

/// The 8-bit grid a block is quantized onto: its bound and how a quotient, clamped to it,
/// becomes a byte.
trait Grid: Copy {
    const MAX: f32;
    fn encode(self, x: f32) -> u8;
}

/// float8_e4m3fn (`fp8_e4m3_block64`, `fp8_e4m3_row`).
#[derive(Clone, Copy)]
struct E4m3;

impl Grid for E4m3 {
    const MAX: f32 = E4M3_MAX;
    #[inline(always)]
    fn encode(self, x: f32) -> u8 {
        e4m3fn_below_480(x)
    }
}

/// int8, rounded half to even as torch's `round` (`int8_row`).
#[derive(Clone, Copy)]
struct Int8;

impl Grid for Int8 {
    const MAX: f32 = INT8_MAX;
    #[inline(always)]
    fn encode(self, x: f32) -> u8 {
        // `x` is within ±127, so the cast is exact and the byte is the two's complement code.
        x.round_ties_even() as i8 as u8
    }
}

/// Quantizes one block of fp32 weights onto `grid` into `q`; returns its scale, or the
/// position of the first non-finite weight.
#[inline(always)]
fn quantize_block<G: Grid>(w: &[f32], q: &mut [u8], grid: G) -> Result<f32, usize> {
    // amax on the bits: with the sign cleared, the order of finite floats is that of their bits,
    // and every infinity or NaN is at or above 0x7F80_0000: one integer max checks both.
    let amax_bits = w.iter().fold(0u32, |m, x| m.max(x.to_bits() & 0x7FFF_FFFF));
    if amax_bits >= 0x7F80_0000 {
        return Err(w.iter().position(|x| !x.is_finite()).expect("a non-finite"));
    }
    let max = G::MAX;
    let scale = f32::from_bits(amax_bits) / max;
    // All zeros, or an amax below qmax × 2^-150 that underflows: 1 keeps q finite (0 for such
    // weights) where a zero scale would make 0/0 = NaN.
    let scale = if scale == 0.0 { 1.0 } else { scale };
    for (q, &x) in q.iter_mut().zip(w) {
        // A division, as torch does; `x * (1 / scale)` is not the same number.
        *q = grid.encode((x / scale).clamp(-max, max));
    }
    Ok(scale)
}

/// `torch.tensor(x, dtype=float32).to(torch.float8_e4m3fn)`, bit for bit: round to nearest,
/// ties to even, with subnormals; magnitudes above 464 (infinities included) and NaN give the
/// NaN code 0x7F with the sign (e4m3fn has no infinities). [`quantize`] clamps to ±448 first.
pub fn f32_to_e4m3fn(x: f32) -> u8 {
    let bits = x.to_bits();
    if bits & 0x7FFF_FFFF >= 0x43F0_0000 {
        // 480 and above, and NaN: torch does not saturate.
        (bits >> 24) as u8 & 0x80 | E4M3_NAN
    } else {
        e4m3fn_below_480(x)
    }
}

/// [`f32_to_e4m3fn`] for |x| < 480 (the quantizer's inner loop, after the clamp).
///
/// e4m3fn is 1 sign, 4 exponent (bias 7) and 3 mantissa bits; S.1111.111 is NaN, so the largest
/// finite value is S.1111.110 = 1.75 × 2^8 = 448, the smallest normal 2^-6, the subnormals
/// m × 2^-9 for m in 1..=7.
///
/// Normal results (|x| ≥ 2^-6, f32 bits `a` ≥ 121 << 23): subtracting 120 << 23 rebiases the
/// exponent field in place (127 - 7 = 120); the 23-bit mantissa must lose its low 20 bits with
/// round-to-nearest-even. Adding 0x7FFFF (half an ulp of the result, less one) plus the lowest
/// kept bit carries into bit 20 exactly when the dropped bits are above half, or exactly half
/// with an odd kept mantissa; a carry out of the mantissa bumps the exponent, which is the right
/// answer (1.111b rounds up to 10.000b). Shifting right by 20 leaves exponent and mantissa in
/// the low 7 bits. 464 (halfway between 448 and the NaN pattern's 480) rounds to 448, the even
/// one; anything above it and below 480 rounds onto the NaN code 0x7F, as in torch.
///
/// Subnormal results (|x| < 2^-6): the result is m = round(|x| / 2^-9) in 0..=8 (8 being 2^-6,
/// whose code is also 8: exponent 1, mantissa 0), so the integer m is the code. Adding 2^14 in
/// fp32 lets the FPU round: on [2^14, 2^15) the f32 ulp is 2^(14-23) = 2^-9, so 2^14 + |x| rounds
/// (to nearest even, the IEEE default) to 2^14 + m × 2^-9, whose bits are (141 << 23) + m.
/// Subtracting the bits of 2^14 leaves m. This is torch's own `fp8e4m3fn_from_fp32_value`.
#[inline(always)]
fn e4m3fn_below_480(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7FFF_FFFF;
    // Both roundings are computed and one is picked, so that the loop stays branch-free.
    let normal = (a
        .wrapping_sub(120 << 23)
        .wrapping_add(0x7FFFF + ((a >> 20) & 1))
        >> 20) as u8;
    let subnormal = (f32::from_bits(a) + 16384.0)
        .to_bits()
        .wrapping_sub(141 << 23) as u8;
    sign | if a < 121 << 23 { subnormal } else { normal }
}

/// The value of an e4m3fn code: `q.to(torch.float32)`.
pub fn e4m3fn_to_f32(q: u8) -> f32 {
    let magnitude = match ((q >> 3) & 0xF, q & 7) {
        (0xF, 7) => f32::NAN,
        (0, m) => f32::from(m) / 512.0,
        (e, m) => f32::from(8 + m) * f32::from_bits((u32::from(e) + 127 - 10) << 23),
    };
    if q & 0x80 != 0 { -magnitude } else { magnitude }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest e4m3fn code to a non-negative `x`, ties to the even code, from the value
    /// table: an independent statement of what `f32_to_e4m3fn` computes. Beyond 448 the next
    /// grid point is the NaN pattern's 480, as in torch.
    fn nearest_code(x: f32) -> u8 {
        assert!(x >= 0.0);
        if x.is_nan() || x >= 480.0 {
            return E4M3_NAN;
        }
        let value = |c: u8| {
            if c == E4M3_NAN {
                480.0
            } else {
                e4m3fn_to_f32(c)
            }
        };
        let hi = (0..=E4M3_NAN).find(|&c| value(c) >= x).expect("x < 480");
        if hi == 0 || value(hi) == x {
            return hi;
        }
        let lo = hi - 1;
        let mid = (value(lo) + value(hi)) / 2.0; // exact: 5 significant bits
        match x.partial_cmp(&mid).expect("finite") {
            std::cmp::Ordering::Less => lo,
            std::cmp::Ordering::Greater => hi,
            std::cmp::Ordering::Equal => {
                if lo % 2 == 0 {
                    lo
                } else {
                    hi
                }
            }
        }
    }

    #[test]
    fn conversion_matches_the_value_table_on_every_midpoint_and_neighbour() {
        let mut inputs = Vec::new();
        for c in 0..E4M3_NAN {
            let lo = e4m3fn_to_f32(c);
            let hi = if c + 1 == E4M3_NAN {
                480.0
            } else {
                e4m3fn_to_f32(c + 1)
            };
            for v in [lo, (lo + hi) / 2.0] {
                let b = v.to_bits();
                inputs.extend((b.saturating_sub(3)..=b + 3).map(f32::from_bits));
            }
        }
        // And a sweep of every exponent with assorted mantissas, up to past 480.
        for hi in 0..=0x4400u32 {
            for lo in [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                inputs.push(f32::from_bits(hi << 16 | lo));
            }
        }
        let bad: Vec<String> = inputs
            .iter()
            .filter(|&&x| f32_to_e4m3fn(x) != nearest_code(x))
            .map(|&x| {
                format!(
                    "{x:e}: {:#04x} != {:#04x}",
                    f32_to_e4m3fn(x),
                    nearest_code(x)
                )
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{} mismatches:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }

    #[test]
    fn conversion_keeps_the_sign_and_maps_nan_and_infinities_to_the_nan_code() {
        let cases = [
            (0.0f32, 0x00u8),
            (-0.0, 0x80),
            (448.0, 0x7E),
            (-448.0, 0xFE),
            (464.0, 0x7E),
            (464.01, 0x7F),
            (f32::INFINITY, 0x7F),
            (f32::NEG_INFINITY, 0xFF),
            (f32::NAN, 0x7F),
            (-1.0, 0xB8),
            (2.0f32.powi(-9), 0x01),
            (-(2.0f32.powi(-10)), 0x80),
        ];
        let bad: Vec<String> = cases
            .iter()
            .filter(|(x, want)| f32_to_e4m3fn(*x) != *want)
            .map(|(x, want)| format!("{x}: got {:#04x}, want {want:#04x}", f32_to_e4m3fn(*x)))
            .collect();
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    #[test]
    fn every_code_round_trips_through_f32() {
        let bad: Vec<u8> = (0..=255u8)
            .filter(|&c| c & 0x7F != E4M3_NAN)
            .filter(|&c| f32_to_e4m3fn(e4m3fn_to_f32(c)) != c)
            .collect();
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(e4m3fn_to_f32(0x7E), 448.0);
        assert_eq!(e4m3fn_to_f32(0x01), 2.0f32.powi(-9));
        assert_eq!(e4m3fn_to_f32(0x08), 2.0f32.powi(-6));
        assert!(e4m3fn_to_f32(0xFF).is_nan());
    }

    #[test]
    fn f16_widening_is_exact_for_every_half() {
        // Against an independent decode: sign × 2^(e-15) × (1 + m/1024), or m × 2^-24.
        let bad: Vec<String> = (0..=u16::MAX)
            .filter_map(|h| {
                let (s, e, m) = (h >> 15, (h >> 10) & 0x1F, f64::from(h & 0x3FF));
                let sign = if s == 1 { -1.0 } else { 1.0 };
                let want = match e {
                    0 => sign * m * 2f64.powi(-24),
                    31 if m == 0.0 => sign * f64::INFINITY,
                    31 => f64::NAN,
                    _ => sign * (1.0 + m / 1024.0) * 2f64.powi(i32::from(e) - 15),
                };
                let got = f64::from(f16_to_f32(h.to_le_bytes()));
                let same = (got.is_nan() && want.is_nan())
                    || (got == want && got.is_sign_negative() == want.is_sign_negative());
                (!same).then(|| format!("{h:#06x}: {got} != {want}"))
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{} mismatches:\n{}",
            bad.len(),
            bad.join("\n")
        );
        // NaN payloads survive (torch keeps them; we only test finiteness, but say it).
        assert_eq!(f16_to_f32(0x7E01u16.to_le_bytes()).to_bits(), 0x7FC0_2000);
    }

    #[test]
    fn parse_accepts_the_documented_spellings() {
        let cases = [
            ("none", Quantization::None),
            ("fp8_e4m3_block64", Quantization::Fp8E4m3Block64),
            ("fp8", Quantization::Fp8E4m3Block64),
            ("fp8_e4m3_row", Quantization::Fp8E4m3Row),
            ("int8_row", Quantization::Int8Row),
        ];
        for (s, want) in cases {
            assert_eq!(Quantization::parse(s), Ok(want), "{s}");
            assert_eq!(s.parse::<Quantization>(), Ok(want), "{s}");
        }
        assert_eq!(Quantization::Fp8E4m3Block64.to_string(), "fp8_e4m3_block64");
        assert_eq!(Quantization::Fp8E4m3Row.to_string(), "fp8_e4m3_row");
        assert_eq!(Quantization::Int8Row.to_string(), "int8_row");
        assert_eq!(Quantization::default(), Quantization::None);
    }

    #[test]
    fn parse_rejects_others_naming_the_field_and_the_accepted_values() {
        let e = Quantization::parse("FP8").unwrap_err();
        assert_eq!(
            e.to_string(),
            "quantization \"FP8\" is not supported: the accepted values are none, \
             fp8_e4m3_block64, fp8 (an alias of fp8_e4m3_block64), fp8_e4m3_row, int8_row"
        );
        let long = "x".repeat(1000);
        let e = Quantization::parse(&long).unwrap_err().to_string();
        assert!(e.len() < 250, "{e}");
    }

    #[test]
    fn layout_views_any_rank_as_rows_by_the_rest() {
        // (shape, rows, cols, block, scale shape)
        type Case = (&'static [u64], usize, usize, usize, [u64; 2]);
        let cases: [Case; 6] = [
            (&[3, 128], 3, 128, 64, [3, 2]),
            (&[3, 100], 3, 100, 100, [3, 1]),
            (&[8, 4, 3, 3], 8, 36, 36, [8, 1]),
            (&[4, 16, 2, 2], 4, 64, 64, [4, 1]),
            (&[2, 3, 128], 2, 384, 64, [2, 6]),
            (&[0, 64], 0, 64, 64, [0, 1]),
        ];
        let bad: Vec<String> = cases
            .iter()
            .filter_map(|&(shape, rows, cols, block, scales)| {
                let l = BlockLayout::of(Target::Fp8Block64, "w", shape).unwrap();
                let got = (l.rows, l.cols, l.block, l.scale_shape());
                let want = (rows, cols, block, scales);
                (got != want).then(|| format!("{shape:?}: {got:?} != {want:?}"))
            })
            .collect();
        assert!(bad.is_empty(), "{}", bad.join("\n"));
        assert_eq!(
            BlockLayout::of(Target::Fp8Block64, "w", &[4, 0])
                .unwrap()
                .scale_shape(),
            [4, 0]
        );
    }

    #[test]
    fn the_row_formats_have_one_scale_per_row_at_any_width() {
        for target in [Target::Fp8Row, Target::Int8Row] {
            for (shape, cols, scales) in [
                (&[3u64, 128][..], 128, [3, 1]),
                (&[3, 100], 100, [3, 1]),
                (&[8, 4, 3, 3], 36, [8, 1]),
                (&[4, 0], 0, [4, 0]),
            ] {
                let l = BlockLayout::of(target, "w", shape).unwrap();
                assert_eq!((l.cols, l.block, l.scale_shape()), (cols, cols, scales));
            }
        }
        let e = BlockLayout::of(Target::Int8Row, "b", &[4]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor 'b' has rank 1: int8_row quantizes only rank ≥ 2 weights"
        );
    }

    #[test]
    fn int8_rows_map_their_amax_to_127_and_round_ties_to_even() {
        // amax 254: scale 2; 1.0 / 2 = 0.5 → 0, 3.0 / 2 = 1.5 → 2, -5.0 / 2 = -2.5 → -2.
        let w = [254.0f32, 1.0, 3.0, -5.0, 0.0, -0.0, 0.0, 0.0];
        let q = quantize_as(Target::Int8Row, "w", DType::F32, &[2, 4], &f32_bytes(&w)).unwrap();
        assert_eq!(q.scale_shape, [2, 1]);
        let scales: Vec<f32> = (q.scales.chunks(4))
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(scales, [2.0, 1.0]);
        let data: Vec<i8> = q.data.iter().map(|&b| b as i8).collect();
        assert_eq!(data, [127, 0, 2, -2, 0, 0, 0, 0]);
    }

    #[test]
    fn layout_rejects_shapes_past_the_address_space() {
        let e = BlockLayout::of(Target::Fp8Block64, "huge", &[u64::MAX, 2]).unwrap_err();
        assert!(matches!(e, QuantizeError::ShapeOverflow { .. }), "{e}");
        let e = BlockLayout::of(Target::Fp8Block64, "huge", &[1 << 40, 1 << 40]).unwrap_err();
        assert!(matches!(e, QuantizeError::ShapeOverflow { .. }), "{e}");
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn a_block_maps_its_amax_to_448_and_zeros_get_scale_one() {
        let mut w = vec![0.0f32; 128];
        w[3] = -896.0; // block 0: amax 896, scale 2
        w[5] = 1.0; // 0.5 → code 0x30
        let q = quantize("w", DType::F32, &[1, 128], &f32_bytes(&w)).unwrap();
        assert_eq!(q.scale_shape, [1, 2]);
        let scales: Vec<f32> = q
            .scales
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(scales, [2.0, 1.0]);
        assert_eq!(q.data[3], 0xFE);
        assert_eq!(q.data[5], 0x30);
        assert!(q.data[64..].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_result_does_not_depend_on_the_thread_count() {
        // Several tensors, one larger than a job, with a row width that is not a multiple of 64.
        let mut x = 0x1234_5678u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let big: Vec<f32> = (0..(JOB_ELEMENTS * 2 + 640)).map(|_| next()).collect();
        let odd: Vec<f32> = (0..(7 * 1000)).map(|_| next() * 1e-3).collect();
        let (big, odd) = (f32_bytes(&big), f32_bytes(&odd));
        let big_shape = [(JOB_ELEMENTS * 2 + 640) as u64 / 128, 128];
        let tensors = [
            TensorIn {
                target: Target::Fp8Block64,
                name: "big",
                dtype: DType::F32,
                shape: &big_shape,
                bytes: &big,
            },
            TensorIn {
                target: Target::Int8Row,
                name: "odd",
                dtype: DType::F32,
                shape: &[7, 1000],
                bytes: &odd,
            },
        ];
        let one = quantize_all(&tensors, NonZeroUsize::MIN).unwrap();
        let four = quantize_all(&tensors, NonZeroUsize::new(4).unwrap()).unwrap();
        assert_eq!(one, four);
        assert_eq!(one[1].scale_shape, [7, 1]);
    }
}
