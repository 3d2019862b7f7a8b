//! Loading safetensors from files the client opened and passed: headers read and checked,
//! tensors placed page-aligned in a new arena, copied in with positioned reads on several
//! threads (progress reported as it goes), pinned, then inserted, where a concurrent load of the
//! same files that finished first wins and this one becomes a reference to it. No lock is held
//! while reading. Each phase is timed ([`Phases`]).
//!
//! A load with a quantization reads the weights it quantizes in batches of rows (at most
//! [`QUANT_BATCH`] bytes of input, two batches in memory: the next is read, on several
//! threads, while this one is quantized on every core) and quantizes them straight into the
//! arena, which holds only the quantized copy.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rustix::fs::FileType;

use super::phases::{Phases, Stored};
use super::prequantized::{self, PreLayout};
use super::quantize::{
    Quantization, QuantizeError, StoredLayout, TensorIn, TensorOut, quantize_all_into,
    quantizes_on_load,
};
use super::safetensors::{self, TensorEntry};
use super::{
    Model, ModelSource, QuantizedLayout, Store, StoreError, StoredTensor, TENSOR_ALIGN,
    metadata_bytes,
};
use crate::mem::{align_up, parallel};

/// Load progress is reported at least this often (in bytes); also the most one reader copies
/// at a time.
const PROGRESS_STEP: u64 = 64 << 20;

/// Threads that read the files at most: positioned reads from the page cache run at a few GB/s
/// each, and memory bandwidth is spent by about this many.
const READERS: usize = 8;

/// Load progress as (bytes done, bytes total, current file).
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64, &Path);

/// One file to load: the fd its client opened, and the name it gave it (for status and
/// errors; the daemon never opens it).
#[derive(Debug)]
pub struct LoadSource {
    pub name: String,
    pub file: File,
}

/// A source as fstat saw it when the load began.
struct Opened<'a> {
    source: &'a LoadSource,
    len: u64,
}

/// Input bytes of one batch of rows to quantize (a row is never split: a batch may hold one
/// row that is larger).
const QUANT_BATCH: u64 = 64 << 20;

/// The piece of a batch one reader thread reads at a time.
const QUANT_READ_PIECE: usize = 8 << 20;

/// One tensor to load: the file it is read from, its entry there, its offset in the arena and,
/// when it is quantized, its layout there.
struct Planned<'a> {
    opened: &'a Opened<'a>,
    entry: TensorEntry,
    offset: u64,
    quantized: Option<StoredLayout>,
    /// A pre-quantized weight's scale tensor (read from its file, stored as fp32 after the
    /// weight's bytes) and the slice's layout.
    pre: Option<PreScale<'a>>,
}

struct PreScale<'a> {
    opened: &'a Opened<'a>,
    entry: TensorEntry,
    layout: PreLayout,
}

impl Planned<'_> {
    /// Bytes it takes in the arena.
    fn nbytes(&self) -> u64 {
        match (&self.pre, self.quantized) {
            (Some(pre), _) => pre.layout.nbytes,
            (None, Some(q)) => q.nbytes,
            (None, None) => self.entry.nbytes,
        }
    }

    /// Bytes it reads from the files.
    fn input_bytes(&self) -> u64 {
        self.entry.nbytes + self.pre.as_ref().map_or(0, |p| p.entry.nbytes)
    }
}

type Plan<'a> = Vec<Planned<'a>>;

impl Store {
    /// Loads safetensors from `sources` (blocking; run it off the async runtime), quantizing
    /// its weights as `quantization` says ([`quantizes_on_load`]). Returns the model, whether it
    /// was already in the store, and where the time went: the arena's allocation, reading (and
    /// quantizing), page-locking. Progress counts the files' bytes.
    pub fn load(
        &self,
        sources: &[LoadSource],
        name: &str,
        quantization: Quantization,
        uid: u32,
        progress: Progress<'_>,
    ) -> Result<Stored, StoreError> {
        let started = Instant::now();
        let mut phases = Phases::default();
        let (id, opened) = identity(sources, quantization)?;
        let last = Path::new(sources.last().map_or("", |s| s.name.as_str()));
        if let Some(model) = self.add_ref(&id, uid) {
            let total = model.total_bytes;
            progress(total, total, last);
            phases.total = started.elapsed();
            return Ok(Stored {
                model,
                existed: true,
                phases,
            });
        }
        let plan = self.plan_load(&opened, quantization)?;
        let total: u64 = plan.iter().map(Planned::input_bytes).sum();
        let arena_len = align_up(
            plan.last().map_or(0, |p| p.offset + p.nbytes()),
            TENSOR_ALIGN,
        );
        let name = if name.is_empty() {
            default_name(sources)
        } else {
            name.to_string()
        };
        let described = || plan.iter().map(|p| (&*p.entry.name, p.entry.shape.len()));
        self.check_description(&name, described())?;
        let metadata = metadata_bytes(&name, described());
        let reserved = self.reserve(uid, arena_len + metadata, false, "model")?;
        progress(0, total, Path::new("allocating host memory"));
        let mut segment = phases
            .time(|p| &mut p.alloc, || self.shm.create("model", arena_len))
            .map_err(|source| StoreError::Arena {
                bytes: arena_len,
                source,
            })?;
        let arena = segment.bytes_mut().expect("a new segment is writable");
        phases.time(
            |p| &mut p.read,
            || fill_arena(&plan, arena, total, progress),
        )?;
        phases.input_bytes = total;
        let tensors: Vec<StoredTensor> = plan
            .into_iter()
            .map(|p| StoredTensor {
                nbytes: p.nbytes(),
                name: p.entry.name,
                dtype: match p.quantized {
                    Some(_) => safetensors::DType::F8E4M3,
                    None => p.entry.dtype,
                },
                shape: p.entry.shape,
                offset: p.offset,
                quantized: match p.pre {
                    Some(pre) => Some(QuantizedLayout {
                        quantization: pre.layout.quantization,
                        scale_shape: pre.layout.scale_shape,
                        scale_offset: pre.layout.scale_offset,
                    }),
                    None => p.quantized.as_ref().map(QuantizedLayout::fp8),
                },
            })
            .collect();
        progress(total, total, Path::new("page-locking host memory"));
        let arena = phases.time(|p| &mut p.pin, || self.pin(segment, &tensors))?;
        phases.nothing_pinned_unless(arena.is_pinned());
        let model = Model::new(id, name, ModelSource::File, tensors, arena);
        let (model, existed) = self.insert_or_ref(Arc::new(model), uid);
        drop(reserved);
        phases.total = started.elapsed();
        Ok(Stored {
            model,
            existed,
            phases,
        })
    }

    /// Reads every header, rejects duplicates and places each tensor in the future arena, at
    /// its quantized size where it is quantized.
    fn plan_load<'a>(
        &self,
        files: &'a [Opened<'a>],
        quantization: Quantization,
    ) -> Result<Plan<'a>, StoreError> {
        let mut seen: HashMap<String, &str> = HashMap::new();
        let mut entries: Vec<(&'a Opened<'a>, TensorEntry)> = Vec::new();
        // Layers a ComfyUI mixed-precision header lists as quantized.
        let mut listed = Vec::new();
        for opened in files {
            let path = opened.source.name.as_str();
            let mut reader = ReadAt {
                file: &opened.source.file,
                at: 0,
            };
            let limits = safetensors::HeaderLimits {
                max_tensors: self.limits.max_tensors as usize,
                max_name_bytes: self.limits.max_name_bytes as usize,
            };
            let header =
                safetensors::read_header(&mut reader, opened.len, limits).map_err(|source| {
                    StoreError::Header {
                        path: path.to_string(),
                        source,
                    }
                })?;
            let count = (seen.len() + header.tensors.len()) as u64;
            if count > u64::from(self.limits.max_tensors) {
                return Err(StoreError::TooManyTensors {
                    count,
                    limit: self.limits.max_tensors,
                });
            }
            listed.extend(prequantized::listed_layers(path, &header.metadata)?);
            for entry in header.tensors {
                if let Some(first) = seen.insert(entry.name.clone(), path) {
                    return Err(StoreError::DuplicateTensor {
                        name: entry.name,
                        first: first.to_string(),
                        second: path.to_string(),
                    });
                }
                entries.push((opened, entry));
            }
        }
        // Pre-quantized weights take their scale tensor into their slice.
        let refs: Vec<&TensorEntry> = entries.iter().map(|(_, e)| e).collect();
        let pairs = prequantized::pair(&refs, &listed, quantization)?;
        let mut scale_of: HashMap<usize, (usize, PreLayout)> = HashMap::new();
        for (weight, scale, layout) in pairs {
            scale_of.insert(weight, (scale, layout));
        }
        let scales: std::collections::HashSet<usize> =
            scale_of.values().map(|(scale, _)| *scale).collect();
        let mut slots: Vec<Option<(&'a Opened<'a>, TensorEntry)>> =
            entries.into_iter().map(Some).collect();
        let mut plan = Vec::new();
        let mut offset = 0u64;
        for i in 0..slots.len() {
            if scales.contains(&i) {
                continue;
            }
            let (opened, entry) = slots[i].take().expect("each tensor is planned once");
            let pre = scale_of.remove(&i).map(|(scale, layout)| {
                let (opened, entry) = slots[scale].take().expect("a scale scales one weight");
                PreScale {
                    opened,
                    entry,
                    layout,
                }
            });
            let quantized = (pre.is_none()
                && quantizes_on_load(quantization, &entry.name, entry.dtype, entry.shape.len()))
            .then(|| StoredLayout::of(&entry.name, &entry.shape))
            .transpose()?;
            offset = align_up(offset, TENSOR_ALIGN);
            let planned = Planned {
                opened,
                entry,
                offset,
                quantized,
                pre,
            };
            offset += planned.nbytes();
            plan.push(planned);
        }
        Ok(plan)
    }
}

/// Positioned reads from the start of a file: the client shares the fd's file offset, which
/// the daemon never moves.
struct ReadAt<'a> {
    file: &'a File,
    at: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// Copies each tensor that keeps its dtype from its file into the arena with positioned reads
/// (unlike a mapping of the source, a file truncated under us is an error here, not a
/// SIGBUS), then quantizes the others into it batch by batch.
fn fill_arena(
    plan: &Plan<'_>,
    arena: &mut [u8],
    total: u64,
    progress: Progress<'_>,
) -> Result<(), StoreError> {
    let mut done = Done {
        done: 0,
        reported: 0,
        total,
    };
    read_plain(plan, arena, &mut done, progress)?;
    quantize_batches(plan, arena, &mut done, progress)?;
    if let Some(p) = plan.last() {
        progress(done.done, total, Path::new(&p.opened.source.name));
    }
    Ok(())
}

/// One piece of the copy: bytes of a tensor's data from its file, or a pre-quantized weight's
/// scales (converted) and padding.
enum ReadPiece<'p, 'a, 'm> {
    Data {
        tensor: &'p Planned<'a>,
        at: u64,
        dst: &'m mut [u8],
    },
    Scales {
        pre: &'p PreScale<'a>,
        /// The weight's slice past its data: padding, then scales.
        tail: &'m mut [u8],
    },
}

/// Copies the tensors that keep their dtype (and pre-quantized weights) into the arena on up
/// to [`READERS`] threads, in pieces of at most [`PROGRESS_STEP`] bytes taken in arena order.
fn read_plain(
    plan: &Plan<'_>,
    arena: &mut [u8],
    done: &mut Done,
    progress: Progress<'_>,
) -> Result<(), StoreError> {
    let mut pieces = Vec::new();
    let mut rest: &mut [u8] = arena;
    let mut consumed = 0u64;
    for p in plan.iter().filter(|p| p.quantized.is_none()) {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((p.offset - consumed) as usize);
        let (slot, tail) = tail.split_at_mut(p.nbytes() as usize);
        rest = tail;
        consumed = p.offset + p.nbytes();
        let (mut data, scales) = slot.split_at_mut(p.entry.nbytes as usize);
        let mut at = 0u64;
        while !data.is_empty() {
            let n = data.len().min(PROGRESS_STEP as usize);
            let (dst, more) = std::mem::take(&mut data).split_at_mut(n);
            data = more;
            pieces.push(ReadPiece::Data { tensor: p, at, dst });
            at += n as u64;
        }
        if let Some(pre) = &p.pre {
            pieces.push(ReadPiece::Scales { pre, tail: scales });
        }
    }
    let threads = parallel::threads_for(pieces.len(), READERS);
    parallel::for_each(pieces, threads, read_piece, |(n, path)| {
        done.add(n, path, &mut *progress)
    })
}

/// Reads one piece; returns the bytes of the files it covered and the file's name.
fn read_piece<'p>(piece: ReadPiece<'p, '_, '_>) -> Result<(u64, &'p str), StoreError> {
    match piece {
        ReadPiece::Data { tensor, at, dst } => {
            read_at(tensor, dst, at)?;
            Ok((dst.len() as u64, &tensor.opened.source.name))
        }
        ReadPiece::Scales { pre, tail } => {
            fill_scales(pre, tail)?;
            Ok((pre.entry.nbytes, &pre.opened.source.name))
        }
    }
}

/// A pre-quantized weight's padding (zeros) and scales (its file's, as fp32) after its data:
/// `tail` is its slice from the end of the data on.
fn fill_scales(pre: &PreScale<'_>, tail: &mut [u8]) -> Result<(), StoreError> {
    let l = &pre.layout;
    let mut bytes = vec![0u8; pre.entry.nbytes as usize];
    (pre.opened.source.file)
        .read_exact_at(&mut bytes, pre.entry.file_offset)
        .map_err(|source| StoreError::Io {
            path: pre.opened.source.name.clone(),
            source,
        })?;
    let (padding, scales) = tail.split_at_mut((l.scale_offset - l.data_bytes) as usize);
    padding.fill(0);
    prequantized::scales_to_f32(&pre.entry.name, l.scale_dtype, &bytes, scales)?;
    Ok(())
}

/// Bytes read so far, and when they were last reported.
struct Done {
    done: u64,
    reported: u64,
    total: u64,
}

impl Done {
    fn add(&mut self, n: u64, path: &str, progress: Progress<'_>) {
        self.done += n;
        if self.done - self.reported >= PROGRESS_STEP {
            self.reported = self.done;
            progress(self.done, self.total, Path::new(path));
        }
    }
}

fn read_at(p: &Planned<'_>, dst: &mut [u8], at: u64) -> Result<(), StoreError> {
    (p.opened.source.file)
        .read_exact_at(dst, p.entry.file_offset + at)
        .map_err(|source| StoreError::Io {
            path: p.opened.source.name.clone(),
            source,
        })
}

/// Rows `first..first + rows` of a tensor to quantize.
struct Piece<'p, 'a> {
    tensor: &'p Planned<'a>,
    first: usize,
    rows: usize,
}

impl Piece<'_, '_> {
    fn layout(&self) -> StoredLayout {
        self.tensor
            .quantized
            .expect("pieces are of quantized tensors")
    }

    /// Input bytes per row.
    fn row_bytes(&self) -> usize {
        self.layout().block.cols * self.tensor.entry.dtype.size() as usize
    }

    fn input_bytes(&self) -> usize {
        self.rows * self.row_bytes()
    }
}

/// Cuts the quantized tensors into batches of whole rows of at most [`QUANT_BATCH`] input
/// bytes (one row at least).
fn batches<'p, 'a>(plan: &'p Plan<'a>) -> Vec<Vec<Piece<'p, 'a>>> {
    let mut out: Vec<Vec<Piece<'p, 'a>>> = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0u64;
    for tensor in plan {
        let Some(layout) = tensor.quantized else {
            continue;
        };
        let row_bytes = (layout.block.cols as u64 * tensor.entry.dtype.size()).max(1);
        let mut first = 0;
        while first < layout.block.rows {
            let room = QUANT_BATCH.saturating_sub(bytes) / row_bytes;
            if room == 0 && !current.is_empty() {
                out.push(std::mem::take(&mut current));
                bytes = 0;
                continue;
            }
            let rows = (room.max(1) as usize).min(layout.block.rows - first);
            current.push(Piece {
                tensor,
                first,
                rows,
            });
            bytes += rows as u64 * row_bytes;
            first += rows;
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Reads a batch's rows into `buf`, one piece after the other.
fn read_batch(batch: &[Piece<'_, '_>], buf: &mut Vec<u8>) -> Result<(), StoreError> {
    buf.clear();
    buf.resize(batch.iter().map(Piece::input_bytes).sum(), 0);
    // One thread reads from the page cache at ~2.5 GB/s (measured on the H200 machine: the
    // quantizing load ran at that rate with one reader): the batch is read in pieces of
    // [`QUANT_READ_PIECE`] on up to [`READERS`] threads.
    let mut jobs = Vec::new();
    let mut rest = buf.as_mut_slice();
    for piece in batch {
        let (mine, tail) = rest.split_at_mut(piece.input_bytes());
        rest = tail;
        let from = (piece.first * piece.row_bytes()) as u64;
        for (k, dst) in mine.chunks_mut(QUANT_READ_PIECE).enumerate() {
            jobs.push((piece.tensor, dst, from + (k * QUANT_READ_PIECE) as u64));
        }
    }
    let threads = parallel::threads_for(jobs.len(), READERS);
    parallel::for_each(jobs, threads, |(t, dst, at)| read_at(t, dst, at), |()| {})
}

/// Quantizes the batches into the arena on every core, reading the next batch meanwhile.
fn quantize_batches(
    plan: &Plan<'_>,
    arena: &mut [u8],
    done: &mut Done,
    progress: Progress<'_>,
) -> Result<(), StoreError> {
    let batches = batches(plan);
    let threads = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
    let (mut current, mut next) = (Vec::new(), Vec::new());
    if let Some(first) = batches.first() {
        read_batch(first, &mut current)?;
    }
    for (i, batch) in batches.iter().enumerate() {
        let (quantized, read) = std::thread::scope(|s| {
            let reader = batches
                .get(i + 1)
                .map(|b| s.spawn(|| read_batch(b, &mut next)));
            let quantized = quantize_batch(batch, &current, arena, threads);
            let read = reader.map_or(Ok(()), |r| r.join().expect("a reader does not panic"));
            (quantized, read)
        });
        quantized?;
        read?;
        std::mem::swap(&mut current, &mut next);
        let path = &batch
            .last()
            .expect("batches are not empty")
            .tensor
            .opened
            .source
            .name;
        done.add(
            batch.iter().map(|p| p.input_bytes() as u64).sum(),
            path,
            progress,
        );
    }
    Ok(())
}

/// Quantizes one batch (its input in `input`) into the pieces' places in the arena.
fn quantize_batch(
    batch: &[Piece<'_, '_>],
    input: &[u8],
    arena: &mut [u8],
    threads: NonZeroUsize,
) -> Result<(), StoreError> {
    // Where each piece's data and scales go: disjoint ranges of the arena.
    let mut ranges = Vec::with_capacity(2 * batch.len());
    for piece in batch {
        let l = piece.layout();
        let base = piece.tensor.offset as usize;
        let per_row_scales = l.block.blocks_per_row() * 4;
        ranges.push((base + piece.first * l.block.cols, piece.rows * l.block.cols));
        ranges.push((
            base + l.scale_offset as usize + piece.first * per_row_scales,
            piece.rows * per_row_scales,
        ));
    }
    let mut outs = disjoint_mut(arena, &ranges).into_iter();
    let shapes: Vec<[u64; 2]> = (batch.iter())
        .map(|p| [p.rows as u64, p.layout().block.cols as u64])
        .collect();
    let mut work = Vec::with_capacity(batch.len());
    let mut at = 0;
    for (piece, shape) in batch.iter().zip(&shapes) {
        let n = piece.input_bytes();
        let input = TensorIn {
            name: &piece.tensor.entry.name,
            dtype: piece.tensor.entry.dtype,
            shape,
            bytes: &input[at..at + n],
        };
        at += n;
        let (data, scales) = (outs.next(), outs.next());
        let out = TensorOut {
            data: data.expect("two ranges per piece"),
            scales: scales.expect("two ranges per piece"),
        };
        work.push((input, out));
    }
    quantize_all_into(work, threads).map_err(|e| match e {
        // The index within the piece, made the index within the tensor.
        QuantizeError::NonFinite { name, value, index } => {
            let piece = (batch.iter())
                .find(|p| p.tensor.entry.name == name)
                .expect("the tensor is in the batch");
            let offset = (piece.first * piece.layout().block.cols) as u64;
            QuantizeError::NonFinite {
                name,
                value,
                index: index + offset,
            }
        }
        other => other,
    })?;
    Ok(())
}

/// Mutable slices of `arena` at `ranges` (start, len), which do not overlap, in their order.
fn disjoint_mut<'a>(arena: &'a mut [u8], ranges: &[(usize, usize)]) -> Vec<&'a mut [u8]> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_unstable_by_key(|&i| ranges[i].0);
    let mut out: Vec<Option<&'a mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = arena;
    let mut consumed = 0;
    for i in order {
        let (start, len) = ranges[i];
        let (_, tail) = rest.split_at_mut(start - consumed);
        let (slice, tail) = tail.split_at_mut(len);
        out[i] = Some(slice);
        rest = tail;
        consumed = start + len;
    }
    out.into_iter().map(|s| s.expect("every range")).collect()
}

/// The model id of these files, and their lengths. The same files unchanged give the same id:
/// (device, inode, size, mtime, ctime) of each. The ctime catches a file rewritten in place
/// with its mtime set back (anyone who can write a file can set its mtime; only the kernel sets
/// its ctime). The quantization is part of it: the same files in another format are another
/// model (without one, the id is what it was before quantization existed).
fn identity(
    sources: &[LoadSource],
    quantization: Quantization,
) -> Result<(String, Vec<Opened<'_>>), StoreError> {
    let mut hasher = blake3::Hasher::new();
    let mut opened = Vec::with_capacity(sources.len());
    for source in sources {
        let stat = rustix::fs::fstat(&source.file).map_err(|e| StoreError::Io {
            path: source.name.clone(),
            source: e.into(),
        })?;
        // The handoff passes regular files only; checked again where the bytes are read.
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(StoreError::NotAFile {
                path: source.name.clone(),
            });
        }
        let key = format!(
            "{}:{}:{}:{}.{}:{}.{}\n",
            stat.st_dev,
            stat.st_ino,
            stat.st_size,
            stat.st_mtime,
            stat.st_mtime_nsec,
            stat.st_ctime,
            stat.st_ctime_nsec,
        );
        hasher.update(key.as_bytes());
        opened.push(Opened {
            source,
            len: stat.st_size as u64,
        });
    }
    if quantization != Quantization::None {
        hasher.update(format!("quantization:{quantization}\n").as_bytes());
    }
    Ok((format!("m-{}", &hasher.finalize().to_hex()[..16]), opened))
}

/// The model's name when the client gave none: the file's stem, or the directory of a
/// sharded model.
fn default_name(sources: &[LoadSource]) -> String {
    let first = Path::new(sources.first().map_or("", |s| s.name.as_str()));
    let base = if sources.len() > 1 {
        first.parent().unwrap_or(first)
    } else {
        first
    };
    base.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::quota::HostQuota;
    use crate::store::test_support::{load_paths, model_file, sources, store_with};

    /// A load holds no lock while it reads: a second load of the same files runs to the end
    /// while the first is stopped in the middle of its reads (its progress callback), and the
    /// first, inserting last, becomes a reference to the second's model (its arena dropped, its
    /// reservation given back: one copy, charged once).
    #[test]
    fn concurrent_loads_of_the_same_files_do_not_wait_on_each_other_and_dedupe_at_insert() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(store_with(HostQuota::default()));
        let path = model_file(dir.path(), "a.safetensors", 1 << 16);
        let (reading_tx, reading_rx) = mpsc::channel::<()>();
        let (second_done_tx, second_done_rx) = mpsc::channel::<()>();
        let first = {
            let (store, path) = (store.clone(), path.clone());
            std::thread::spawn(move || {
                let mut waited = None;
                let mut progress = |_: u64, _: u64, _: &Path| {
                    if waited.is_none() {
                        reading_tx.send(()).unwrap();
                        waited = Some(second_done_rx.recv_timeout(Duration::from_secs(10)));
                    }
                };
                let loaded =
                    store.load(&sources(&[path]), "", Quantization::None, 1, &mut progress);
                (loaded.map(|s| (s.model, s.existed)), waited)
            })
        };
        reading_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let (second, existed) = load_paths(&store, &[path], 2).unwrap();
        assert!(!existed, "the second load finished first");
        second_done_tx.send(()).unwrap();
        let (first, waited) = first.join().unwrap();
        assert_eq!(waited, Some(Ok(())), "the second load waited on the first");
        let (first, existed) = first.unwrap();
        assert!(existed && Arc::ptr_eq(&first, &second));
        assert_eq!(store.models().len(), 1);
        assert_eq!(store.shm.total(), 1, "the first load's arena is gone");
        let charged = second.host_bytes();
        assert_eq!(store.host_use(2).uid_bytes, charged);
        assert_eq!(
            store.host_use(1).total_bytes,
            charged,
            "no reservation left"
        );
        let entry = store.get(&second.id).unwrap();
        assert_eq!((entry.refs, entry.charged_uid), (2, 2));
    }

    /// A file rewritten in place, same size, with its mtime set back is a new model: its ctime
    /// moved (only the kernel sets it), and the new bytes are loaded.
    #[test]
    fn a_file_rewritten_with_its_mtime_restored_gets_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let path = model_file(dir.path(), "a.safetensors", 4096);
        let (before, _) = load_paths(&store, std::slice::from_ref(&path), 1).unwrap();
        let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
        // Past the coarse clock's tick, so that the rewrite's ctime differs.
        std::thread::sleep(Duration::from_millis(20));
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        file.write_all_at(&[9u8; 4096], len - 4096).unwrap();
        file.set_modified(mtime).unwrap();
        drop(file);
        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
        assert_ne!(mtime, SystemTime::UNIX_EPOCH);
        let (after, existed) = load_paths(&store, &[path], 1).unwrap();
        assert!(!existed, "same (dev, ino, size, mtime): {}", after.id);
        assert_ne!(after.id, before.id);
        assert_eq!(after.slice(0).bytes(), &[9u8; 4096][..]);
        assert_eq!(before.slice(0).bytes(), &[7u8; 4096][..]);
    }

    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let source = LoadSource {
            name: "/models/dir".into(),
            file: File::open(dir.path()).unwrap(),
        };
        let err = store
            .load(&[source], "", Quantization::None, 1, &mut |_, _, _| {})
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/models/dir: not a regular file: only regular files can be loaded"
        );
    }

    /// Tensors larger than a reader's piece, and several of them, are read on several threads
    /// into the right places, every byte; the load says where its time went.
    #[test]
    fn a_load_is_read_in_pieces_on_several_threads_and_timed() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let sizes = [2 * PROGRESS_STEP as usize + 12_345, 1, 5 * 4096 + 7];
        let data: Vec<Vec<u8>> = (sizes.iter().enumerate())
            .map(|(t, &n)| (0..n).map(|i| ((i * 7 + t) % 251) as u8).collect())
            .collect();
        let names = ["a", "b", "c"];
        let views = (names.iter().zip(&data)).map(|(name, d)| {
            let view =
                ::safetensors::tensor::TensorView::new(::safetensors::Dtype::U8, vec![d.len()], d);
            (*name, view.unwrap())
        });
        let path = dir.path().join("m.safetensors");
        ::safetensors::serialize_to_file(views, None, &path).unwrap();
        let mut events = 0;
        let stored = store
            .load(
                &sources(&[path]),
                "",
                Quantization::None,
                1,
                &mut |_, _, _| events += 1,
            )
            .unwrap();
        let model = &stored.model;
        for (name, d) in names.iter().zip(&data) {
            let i = model.tensor_index(name).unwrap();
            assert!(model.slice(i).bytes() == &d[..], "tensor {name}");
        }
        let p = stored.phases;
        let total: u64 = sizes.iter().map(|&n| n as u64).sum();
        assert_eq!(p.input_bytes, total);
        assert!(!p.read.is_zero() && !p.alloc.is_zero(), "{p:?}");
        assert!(p.total >= p.alloc + p.read + p.pin, "{p:?}");
        assert!(events >= 3, "progress as the pieces come: {events}");
    }
}
