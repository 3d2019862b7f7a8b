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
//!
//! A load with a [`Selection`] reads, holds and charges only the tensors it names; the rest of
//! the files' headers is still read and checked.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::num::NonZeroUsize;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rustix::fs::FileType;

use super::coding::{Coding, coded_id};
use super::phases::{Phases, Stored};
use super::prequantized::{self, PreLayout};
use super::quantize::{
    Quantization, QuantizeError, StoredLayout, Target, TensorIn, TensorOut, quantize_all_into,
    quantizes_on_load,
};
use super::safetensors::{self, TensorEntry};
use super::{
    Model, ModelSource, Owner, QuantizedLayout, Retention, Store, StoreError, StoredTensor,
    TENSOR_ALIGN, metadata_bytes,
};
use crate::mem::shm::Pages;
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

/// Which tensors of its files a load reads: every one, or those named. A set: the same names in
/// any order are the same selection, and so the same model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Selection {
    #[default]
    All,
    Only(BTreeSet<String>),
}

impl Selection {
    fn contains(&self, name: &str) -> bool {
        match self {
            Selection::All => true,
            Selection::Only(names) => names.contains(name),
        }
    }

    /// Adds it to a digest (a model's id, a file key). All adds nothing: a load of every
    /// tensor keeps the id it had before selections existed.
    fn hash_into(&self, hasher: &mut blake3::Hasher) {
        if let Selection::Only(names) = self {
            hasher.update(format!("tensors {}\n", names.len()).as_bytes());
            for name in names {
                hasher.update(format!("{}\0{name}\n", name.len()).as_bytes());
            }
        }
    }
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
    /// Loads safetensors from `sources` (blocking; run it off the async runtime), the tensors
    /// `selection` names (each must be in the files), quantizing its weights as `quantization`
    /// says ([`quantizes_on_load`]). Returns the model, whether it
    /// was already in the store, and where the time went: the arena's allocation, reading (and
    /// quantizing), page-locking. The reference is `owner`'s (its uid's, taken by its
    /// connection) and lasts as `retention` says. Progress counts the files' bytes.
    pub fn load(
        &self,
        sources: &[LoadSource],
        name: &str,
        quantization: Quantization,
        selection: &Selection,
        held: (Owner, Retention),
        progress: Progress<'_>,
    ) -> Result<Stored, StoreError> {
        let how = (quantization, Coding::None);
        self.load_coded(sources, name, how, selection, held, progress)
    }

    /// [`Store::load`], the model then coded as `coding` says ([`super::coding`]).
    pub fn load_coded(
        &self,
        sources: &[LoadSource],
        name: &str,
        (quantization, coding): (Quantization, Coding),
        selection: &Selection,
        (owner, retention): (Owner, Retention),
        progress: Progress<'_>,
    ) -> Result<Stored, StoreError> {
        let started = Instant::now();
        let mut phases = Phases::default();
        let (key, opened) = file_key(sources, (quantization, coding), selection)?;
        let (plan, headers) = self.plan_load(&opened, quantization, selection)?;
        let total: u64 = plan.iter().map(Planned::input_bytes).sum();
        let last = Path::new(sources.last().map_or("", |s| s.name.as_str()));
        // Files that look unchanged since a model was loaded from them are read and hashed
        // (nothing allocated); the model is theirs only if the bytes are still the same.
        if self.has_file_key(&key) {
            let digests = phases.time(|p| &mut p.hash, || digest_files(&plan))?;
            let id = coded_id(
                &model_id(&headers, &digests, quantization, selection),
                coding,
            );
            if let Some(model) = self.add_ref(&id, owner, retention) {
                progress(total, total, last);
                phases.total = started.elapsed();
                return Ok(Stored {
                    model,
                    existed: true,
                    phases,
                });
            }
        }
        let name = if name.is_empty() {
            default_name(sources)
        } else {
            name.to_string()
        };
        let described = || plan.iter().map(|p| (&*p.entry.name, p.entry.shape.len()));
        self.check_description(&name, described(), 0)?;
        let metadata = metadata_bytes(&name, described());
        let arena_len = align_up(
            plan.last().map_or(0, |p| p.offset + p.nbytes()),
            TENSOR_ALIGN,
        );
        let reserved = self.reserve(owner.uid, arena_len + metadata, false, "model")?;
        progress(0, total, Path::new("allocating host memory"));
        // Coded in place (`Store::code`), then cut to its coded size.
        let create = || match coding {
            Coding::None => self.shm.create("model", arena_len),
            _ => (self.shm).create_shrinkable("model", arena_len, Pages::Reserved),
        };
        let mut segment =
            phases
                .time(|p| &mut p.alloc, create)
                .map_err(|source| StoreError::Arena {
                    bytes: arena_len,
                    source,
                })?;
        let arena = segment.bytes_mut().expect("a new segment is writable");
        let digests = phases.time(
            |p| &mut p.read,
            || fill_arena(&plan, arena, total, progress),
        )?;
        phases.input_bytes = total;
        // The model is what was read: its id is the digest of those bytes.
        let id = coded_id(
            &model_id(&headers, &digests, quantization, selection),
            coding,
        );
        if let Some(model) = self.add_ref(&id, owner, retention) {
            // The same bytes are stored already (other files, or the same ones changed back):
            // the copy just made goes, unpinned.
            drop((segment, reserved));
            phases.total = started.elapsed();
            return Ok(Stored {
                model,
                existed: true,
                phases,
            });
        }
        let tensors = stored_tensors(plan);
        let (segment, tensors) = if coding == Coding::None {
            (segment, tensors)
        } else {
            progress(total, total, Path::new("coding the weights"));
            phases.time(
                |p| &mut p.code,
                || self.code(owner.uid, segment, tensors, coding),
            )?
        };
        progress(total, total, Path::new("page-locking host memory"));
        let arena = phases.time(|p| &mut p.pin, || self.pin(segment, &tensors))?;
        phases.nothing_pinned_unless(arena.is_pinned());
        let mut model = Model::new(id, name, ModelSource::File, tensors, arena);
        model.file_key = Some(key);
        let (model, existed) = self.insert_or_ref(Arc::new(model), owner, retention);
        drop(reserved);
        phases.total = started.elapsed();
        Ok(Stored {
            model,
            existed,
            phases,
        })
    }

    /// Reads every header, rejects duplicates and places each tensor `selection` names in the
    /// future arena, at its quantized size where it is quantized. Returns the plan and the
    /// digest of the headers as parsed (part of the model's id).
    fn plan_load<'a>(
        &self,
        files: &'a [Opened<'a>],
        quantization: Quantization,
        selection: &Selection,
    ) -> Result<(Plan<'a>, blake3::Hash), StoreError> {
        let mut headers = blake3::Hasher::new();
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
            hash_header(&mut headers, &header);
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
        check_selection(selection, &seen, files, &refs, &scale_of)?;
        let scales: HashSet<usize> = scale_of.values().map(|(scale, _)| *scale).collect();
        let mut slots: Vec<Option<(&'a Opened<'a>, TensorEntry)>> =
            entries.into_iter().map(Some).collect();
        let mut plan = Vec::new();
        let mut offset = 0u64;
        for i in 0..slots.len() {
            let selected = (slots[i].as_ref()).is_some_and(|(_, e)| selection.contains(&e.name));
            if scales.contains(&i) || !selected {
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
            .then(|| {
                let target = Target::of(quantization).expect("quantizes_on_load checked it");
                StoredLayout::of(target, &entry.name, &entry.shape)
            })
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
        Ok((plan, headers.finalize()))
    }
}

/// Refuses a selection that names a tensor none of the files hold (naming the first files), or
/// a pre-quantized weight's scale, which is stored in its weight's slice.
fn check_selection(
    selection: &Selection,
    seen: &HashMap<String, &str>,
    files: &[Opened<'_>],
    entries: &[&TensorEntry],
    scale_of: &HashMap<usize, (usize, PreLayout)>,
) -> Result<(), StoreError> {
    let Selection::Only(names) = selection else {
        return Ok(());
    };
    if let Some(name) = names.iter().find(|n| !seen.contains_key(n.as_str())) {
        // The first few files name the model; a sharded one has hundreds.
        const SHOWN: usize = 3;
        let shown: Vec<&str> = (files.iter().take(SHOWN))
            .map(|f| f.source.name.as_str())
            .collect();
        let mut files_named = shown.join(", ");
        if files.len() > SHOWN {
            files_named.push_str(&format!(" and {} more", files.len() - SHOWN));
        }
        return Err(StoreError::NotInFiles {
            name: name.clone(),
            files: files_named,
        });
    }
    for (weight, (scale, _)) in scale_of {
        let name = &entries[*scale].name;
        if names.contains(name) {
            return Err(StoreError::SelectedScale {
                name: name.clone(),
                weight: entries[*weight].name.clone(),
            });
        }
    }
    Ok(())
}

/// Where each planned tensor is in the arena, and how it is held there.
fn stored_tensors(plan: Plan<'_>) -> Vec<StoredTensor> {
    plan.into_iter()
        .map(|p| StoredTensor {
            nbytes: p.nbytes(),
            name: p.entry.name,
            dtype: match p.quantized {
                Some(layout) => layout.block.target.data_dtype(),
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
                None => p.quantized.as_ref().map(QuantizedLayout::made),
            },
            label: None,
            coded: None,
        })
        .collect()
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
/// SIGBUS), then quantizes the others into it batch by batch. Returns the digest of each
/// range read ([`ranges_read`]'s order), taken of the bytes as they were read.
fn fill_arena(
    plan: &Plan<'_>,
    arena: &mut [u8],
    total: u64,
    progress: Progress<'_>,
) -> Result<Vec<Digest>, StoreError> {
    let mut done = Done {
        done: 0,
        reported: 0,
        total,
    };
    let mut digests = read_plain(plan, arena, &mut done, progress)?;
    digests.extend(quantize_batches(plan, arena, &mut done, progress)?);
    if let Some(p) = plan.last() {
        progress(done.done, total, Path::new(&p.opened.source.name));
    }
    Ok(digests)
}

/// A BLAKE3 digest of one range read.
type Digest = [u8; 32];

/// What a load reads besides the weights it quantizes, in arena order: each tensor's data in
/// pieces of at most [`PROGRESS_STEP`] bytes, and after a pre-quantized weight its scales.
enum PlainJob<'p, 'a> {
    Data {
        tensor: &'p Planned<'a>,
        at: u64,
        len: u64,
    },
    Scales {
        weight: &'p Planned<'a>,
        pre: &'p PreScale<'a>,
    },
}

fn plain_jobs<'p, 'a>(plan: &'p Plan<'a>) -> Vec<PlainJob<'p, 'a>> {
    let mut jobs = Vec::new();
    for p in plan.iter().filter(|p| p.quantized.is_none()) {
        let mut at = 0u64;
        while at < p.entry.nbytes {
            let len = (p.entry.nbytes - at).min(PROGRESS_STEP);
            jobs.push(PlainJob::Data { tensor: p, at, len });
            at += len;
        }
        if let Some(pre) = &p.pre {
            jobs.push(PlainJob::Scales { weight: p, pre });
        }
    }
    jobs
}

impl<'a> PlainJob<'_, 'a> {
    /// Where its bytes go in the arena: (start, len).
    fn arena_range(&self) -> (usize, usize) {
        match self {
            PlainJob::Data { tensor, at, len } => ((tensor.offset + at) as usize, *len as usize),
            // The weight's slice past its data: padding, then scales.
            PlainJob::Scales { weight, .. } => (
                (weight.offset + weight.entry.nbytes) as usize,
                (weight.nbytes() - weight.entry.nbytes) as usize,
            ),
        }
    }

    /// What it reads from a file.
    fn file_range(&self) -> FileRange<'a> {
        match self {
            PlainJob::Data { tensor, at, len } => FileRange {
                source: tensor.opened.source,
                offset: tensor.entry.file_offset + at,
                len: *len,
            },
            PlainJob::Scales { pre, .. } => FileRange {
                source: pre.opened.source,
                offset: pre.entry.file_offset,
                len: pre.entry.nbytes,
            },
        }
    }
}

/// A range of a file that a load reads.
struct FileRange<'a> {
    source: &'a LoadSource,
    offset: u64,
    len: u64,
}

/// Every range a load reads, in the order its digests make the model's id: the plain jobs,
/// then each batch's chunks of rows to quantize.
fn ranges_read<'a>(plan: &Plan<'a>) -> Vec<FileRange<'a>> {
    let mut ranges: Vec<FileRange<'a>> =
        plain_jobs(plan).iter().map(PlainJob::file_range).collect();
    for batch in batches(plan) {
        ranges.extend(
            batch_chunks(&batch)
                .into_iter()
                .map(|(tensor, from, len)| FileRange {
                    source: tensor.opened.source,
                    offset: tensor.entry.file_offset + from,
                    len: len as u64,
                }),
        );
    }
    ranges
}

/// Reads the ranges a load of `plan` would read and hashes them, storing nothing: the
/// digests [`fill_arena`] would give for the files as they are now.
fn digest_files(plan: &Plan<'_>) -> Result<Vec<Digest>, StoreError> {
    let ranges = ranges_read(plan);
    let mut digests = vec![[0u8; 32]; ranges.len()];
    let threads = parallel::threads_for(ranges.len(), READERS);
    let work = |(k, r): (usize, FileRange<'_>)| {
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; (r.len as usize).min(QUANT_READ_PIECE)];
        let mut at = 0u64;
        while at < r.len {
            let n = ((r.len - at) as usize).min(buf.len());
            (r.source.file)
                .read_exact_at(&mut buf[..n], r.offset + at)
                .map_err(|source| StoreError::Io {
                    path: r.source.name.clone(),
                    source,
                })?;
            hasher.update(&buf[..n]);
            at += n as u64;
        }
        Ok::<_, StoreError>((k, *hasher.finalize().as_bytes()))
    };
    let items = ranges.into_iter().enumerate().collect();
    parallel::for_each(items, threads, work, |(k, d)| digests[k] = d)?;
    Ok(digests)
}

/// Copies the tensors that keep their dtype (and pre-quantized weights) into the arena on up
/// to [`READERS`] threads, in the pieces [`plain_jobs`] cuts, taken in arena order; returns
/// each piece's digest.
fn read_plain(
    plan: &Plan<'_>,
    arena: &mut [u8],
    done: &mut Done,
    progress: Progress<'_>,
) -> Result<Vec<Digest>, StoreError> {
    let jobs = plain_jobs(plan);
    let ranges: Vec<(usize, usize)> = jobs.iter().map(PlainJob::arena_range).collect();
    let pieces: Vec<(usize, PlainJob<'_, '_>, &mut [u8])> = (jobs.into_iter())
        .zip(disjoint_mut(arena, &ranges))
        .enumerate()
        .map(|(k, (job, dst))| (k, job, dst))
        .collect();
    let mut digests = vec![[0u8; 32]; pieces.len()];
    let threads = parallel::threads_for(pieces.len(), READERS);
    parallel::for_each(pieces, threads, read_piece, |(k, n, path, digest)| {
        digests[k] = digest;
        done.add(n, path, &mut *progress)
    })?;
    Ok(digests)
}

/// Reads one piece into `dst`; returns its index, the bytes of the files it covered, the
/// file's name and the digest of the bytes read.
fn read_piece<'p>(
    (k, job, dst): (usize, PlainJob<'p, '_>, &mut [u8]),
) -> Result<(usize, u64, &'p str, Digest), StoreError> {
    match job {
        PlainJob::Data { tensor, at, .. } => {
            read_at(tensor, dst, at)?;
            let digest = *blake3::hash(dst).as_bytes();
            Ok((k, dst.len() as u64, &tensor.opened.source.name, digest))
        }
        PlainJob::Scales { pre, .. } => {
            let digest = fill_scales(pre, dst)?;
            Ok((k, pre.entry.nbytes, &pre.opened.source.name, digest))
        }
    }
}

/// A pre-quantized weight's padding (zeros) and scales (its file's, as fp32) after its data:
/// `tail` is its slice from the end of the data on. Returns the digest of the scales as read.
fn fill_scales(pre: &PreScale<'_>, tail: &mut [u8]) -> Result<Digest, StoreError> {
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
    Ok(*blake3::hash(&bytes).as_bytes())
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

/// The chunks a batch is read in: (tensor, offset in the tensor's data, length), each at most
/// [`QUANT_READ_PIECE`] bytes, its pieces' rows one after the other.
fn batch_chunks<'p, 'a>(batch: &[Piece<'p, 'a>]) -> Vec<(&'p Planned<'a>, u64, usize)> {
    let mut chunks = Vec::new();
    for piece in batch {
        let from = (piece.first * piece.row_bytes()) as u64;
        let mut at = 0;
        while at < piece.input_bytes() {
            let len = (piece.input_bytes() - at).min(QUANT_READ_PIECE);
            chunks.push((piece.tensor, from + at as u64, len));
            at += len;
        }
    }
    chunks
}

/// Reads a batch's rows into `buf`, one piece after the other; returns each chunk's digest.
fn read_batch(batch: &[Piece<'_, '_>], buf: &mut Vec<u8>) -> Result<Vec<Digest>, StoreError> {
    buf.clear();
    buf.resize(batch.iter().map(Piece::input_bytes).sum(), 0);
    // One thread reads from the page cache at ~2.5 GB/s (measured on the H200 machine: the
    // quantizing load ran at that rate with one reader): the batch is read in chunks of
    // [`QUANT_READ_PIECE`] on up to [`READERS`] threads.
    let mut jobs = Vec::new();
    let mut rest = buf.as_mut_slice();
    for (k, (tensor, at, len)) in batch_chunks(batch).into_iter().enumerate() {
        let (dst, tail) = rest.split_at_mut(len);
        rest = tail;
        jobs.push((k, tensor, dst, at));
    }
    let mut digests = vec![[0u8; 32]; jobs.len()];
    let threads = parallel::threads_for(jobs.len(), READERS);
    let read = |(k, t, dst, at): (usize, &Planned<'_>, &mut [u8], u64)| {
        read_at(t, dst, at)?;
        Ok::<_, StoreError>((k, *blake3::hash(dst).as_bytes()))
    };
    parallel::for_each(jobs, threads, read, |(k, d)| digests[k] = d)?;
    Ok(digests)
}

/// Quantizes the batches into the arena on every core, reading the next batch meanwhile.
fn quantize_batches(
    plan: &Plan<'_>,
    arena: &mut [u8],
    done: &mut Done,
    progress: Progress<'_>,
) -> Result<Vec<Digest>, StoreError> {
    let batches = batches(plan);
    let threads = std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN);
    let (mut current, mut next) = (Vec::new(), Vec::new());
    let mut digests = Vec::new();
    if let Some(first) = batches.first() {
        digests.extend(read_batch(first, &mut current)?);
    }
    for (i, batch) in batches.iter().enumerate() {
        let (quantized, read) = std::thread::scope(|s| {
            let reader = batches
                .get(i + 1)
                .map(|b| s.spawn(|| read_batch(b, &mut next)));
            let quantized = quantize_batch(batch, &current, arena, threads);
            let read = reader.map_or(Ok(Vec::new()), |r| {
                r.join().expect("a reader does not panic")
            });
            (quantized, read)
        });
        quantized?;
        digests.extend(read?);
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
    Ok(digests)
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
            target: piece.layout().block.target,
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

/// What these files look like from outside, and their lengths: (device, inode, size, mtime,
/// ctime) of each, the quantization and the selection. A model loaded from files with this key is worth
/// checking against their bytes before reading them into a new arena; the key alone never
/// decides (a writable shared mapping changes a file and none of these).
fn file_key<'a>(
    sources: &'a [LoadSource],
    (quantization, coding): (Quantization, Coding),
    selection: &Selection,
) -> Result<(String, Vec<Opened<'a>>), StoreError> {
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
    hasher.update(format!("quantization:{quantization}\n").as_bytes());
    if coding != Coding::None {
        hasher.update(format!("coding:{}\n", coding.name()).as_bytes());
    }
    selection.hash_into(&mut hasher);
    Ok((hasher.finalize().to_hex().to_string(), opened))
}

/// Adds a header, as parsed, to the digest of a load's headers: each tensor's name, dtype,
/// shape and place in its file, and the metadata (which says how pre-quantized layers pair).
fn hash_header(hasher: &mut blake3::Hasher, header: &safetensors::Header) {
    hasher.update(format!("file {}\n", header.tensors.len()).as_bytes());
    for t in &header.tensors {
        let line = format!(
            "{}\0{}\0{:?}\0{}\0{}\n",
            t.name, t.dtype, t.shape, t.file_offset, t.nbytes
        );
        hasher.update(line.as_bytes());
    }
    for (key, value) in &header.metadata {
        hasher.update(format!("{}\0{key}\0{}\0{value}\n", key.len(), value.len()).as_bytes());
    }
}

/// A file model's id: the digest of what the load read (the headers as parsed, the digest of
/// each range read, in order), of the quantization and of the selection, 128 bits of it. The
/// same bytes and selection give the same id whichever files they come from; other bytes or
/// another selection, another id.
fn model_id(
    headers: &blake3::Hash,
    ranges: &[Digest],
    quantization: Quantization,
    selection: &Selection,
) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(headers.as_bytes());
    for digest in ranges {
        hasher.update(digest);
    }
    hasher.update(format!("quantization:{quantization}\n").as_bytes());
    selection.hash_into(&mut hasher);
    format!("m-{}", &hasher.finalize().to_hex()[..32])
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
    use crate::store::test_support::{load_paths, me, model_file, sources, store_with};

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
                let loaded = store.load(
                    &sources(&[path]),
                    "",
                    Quantization::None,
                    &Selection::All,
                    me(1),
                    &mut progress,
                );
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
            .load(
                &[source],
                "",
                Quantization::None,
                &Selection::All,
                me(1),
                &mut |_, _, _| {},
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/models/dir: not a regular file: only regular files can be loaded"
        );
    }

    /// A check of unchanged files reads and hashes the ranges a load of them reads, in the same
    /// order, and takes the same digests: plain tensors in pieces, weights quantized while
    /// loading in chunks of rows. Each range is one digest, so the id covers every byte.
    #[test]
    fn a_check_of_unchanged_files_takes_the_digests_their_load_took() {
        let dir = tempfile::tempdir().unwrap();
        // A bf16 weight of two read chunks (quantized or not), and a small plain tensor.
        let (rows, cols) = (2304usize, 2048usize);
        let weight: Vec<u8> = (0..rows * cols)
            .flat_map(|i| half_bf16(((i % 97) as f32 - 48.0) / 7.0))
            .collect();
        let small = vec![5u8; 5000];
        let views = [
            (
                "a.weight",
                ::safetensors::Dtype::BF16,
                vec![rows, cols],
                &weight[..],
            ),
            ("b", ::safetensors::Dtype::U8, vec![5000], &small[..]),
        ]
        .map(|(name, dtype, shape, data)| {
            (
                name,
                ::safetensors::tensor::TensorView::new(dtype, shape, data).unwrap(),
            )
        });
        let path = dir.path().join("m.safetensors");
        ::safetensors::serialize_to_file(views, None, &path).unwrap();
        let store = store_with(HostQuota::default());
        let sources = sources(&[path]);
        // Unquantized, the weight is one piece; quantized, two chunks of rows.
        for (quantization, ranges) in [(Quantization::None, 2), (Quantization::Fp8E4m3Block64, 3)] {
            let (_, opened) =
                file_key(&sources, (quantization, Coding::None), &Selection::All).unwrap();
            let (plan, _) = store
                .plan_load(&opened, quantization, &Selection::All)
                .unwrap();
            let len = plan.last().map_or(0, |p| p.offset + p.nbytes());
            let mut arena = vec![0u8; len as usize];
            let total = plan.iter().map(Planned::input_bytes).sum();
            let read = fill_arena(&plan, &mut arena, total, &mut |_, _, _| {}).unwrap();
            assert_eq!(read.len(), ranges, "{quantization}");
            assert_eq!(read, digest_files(&plan).unwrap(), "{quantization}");
        }
    }

    fn half_bf16(x: f32) -> [u8; 2] {
        let bits = (x.to_bits() >> 16) as u16;
        bits.to_le_bytes()
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
                &Selection::All,
                me(1),
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

    /// A file of `tensors` (name, bytes) as U8 vectors.
    fn u8_file(dir: &Path, file: &str, tensors: &[(&str, Vec<u8>)]) -> std::path::PathBuf {
        let views = tensors.iter().map(|(name, d)| {
            let view =
                ::safetensors::tensor::TensorView::new(::safetensors::Dtype::U8, vec![d.len()], d);
            (*name, view.unwrap())
        });
        let path = dir.join(file);
        ::safetensors::serialize_to_file(views, None, &path).unwrap();
        path
    }

    fn only(names: &[&str]) -> Selection {
        Selection::Only(names.iter().map(|n| n.to_string()).collect())
    }

    /// A selection reads, holds and charges only the tensors it names, from every file: the
    /// others' bytes are neither read nor in the arena.
    #[test]
    fn a_selection_loads_only_its_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let data = |n: usize, t: u8| (0..n).map(|i| (i % 251) as u8 ^ t).collect::<Vec<u8>>();
        let paths = [
            u8_file(
                dir.path(),
                "1.safetensors",
                &[("a", data(5000, 1)), ("b", data(9000, 2))],
            ),
            u8_file(
                dir.path(),
                "2.safetensors",
                &[("c", data(300, 3)), ("d", data(7000, 4))],
            ),
        ];
        let stored = store
            .load(
                &sources(&paths),
                "",
                Quantization::None,
                &only(&["d", "a"]),
                me(1),
                &mut |_, _, _| {},
            )
            .unwrap();
        let model = &stored.model;
        let names: Vec<&str> = model.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "d"]);
        assert_eq!(model.slice(0).bytes(), &data(5000, 1)[..]);
        assert_eq!(model.slice(1).bytes(), &data(7000, 4)[..]);
        assert_eq!(stored.phases.input_bytes, 12_000);
        // a at 0, d at the next TENSOR_ALIGN: the arena ends with d.
        let arena = align_up(align_up(5000, TENSOR_ALIGN) + 7000, TENSOR_ALIGN);
        assert_eq!(model.host_bytes() - model.metadata_bytes, arena);
        assert_eq!(store.host_use(1).uid_bytes, model.host_bytes());
    }

    /// Quantized while loading, a selection quantizes only the weights it names: each equal to
    /// the same weight of a load of every tensor, bit for bit.
    #[test]
    fn a_quantized_selection_loads_only_its_weights() {
        let dir = tempfile::tempdir().unwrap();
        let (rows, cols) = (64usize, 128usize);
        let weight = |k: usize| -> Vec<u8> {
            (0..rows * cols)
                .flat_map(|i| half_bf16(((i * k % 89) as f32 - 44.0) / 9.0))
                .collect()
        };
        let (w1, w2) = (weight(3), weight(5));
        let views = [("x.weight", &w1), ("y.weight", &w2)].map(|(name, data)| {
            let dtype = ::safetensors::Dtype::BF16;
            let view = ::safetensors::tensor::TensorView::new(dtype, vec![rows, cols], data);
            (name, view.unwrap())
        });
        let path = dir.path().join("m.safetensors");
        ::safetensors::serialize_to_file(views, None, &path).unwrap();
        let store = store_with(HostQuota::default());
        let q = Quantization::Fp8E4m3Block64;
        let load = |selection: &Selection| {
            store
                .load(
                    &sources(std::slice::from_ref(&path)),
                    "",
                    q,
                    selection,
                    me(1),
                    &mut |_, _, _| {},
                )
                .unwrap()
        };
        let all = load(&Selection::All).model;
        let some = load(&only(&["y.weight"]));
        let names: Vec<&str> = some.model.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["y.weight"]);
        assert_eq!(some.phases.input_bytes, (rows * cols * 2) as u64);
        let y = all.tensor_index("y.weight").unwrap();
        assert_eq!(some.model.tensors[0].quantized, all.tensors[y].quantized);
        assert!(some.model.slice(0).bytes() == all.slice(y).bytes());
        assert_eq!(
            some.model.host_bytes() - some.model.metadata_bytes,
            align_up(all.tensors[y].nbytes, TENSOR_ALIGN)
        );
    }

    /// The id covers the selection: the same files and names (a set: their order is not
    /// kept) are one model, referenced again; other names another model, even where the bytes
    /// read are the same (two tensors of equal bytes).
    #[test]
    fn the_model_id_covers_the_selection() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let path = u8_file(
            dir.path(),
            "m.safetensors",
            &[
                ("a", vec![1; 4096]),
                ("b", vec![1; 4096]),
                ("c", vec![2; 10]),
            ],
        );
        let load = |selection: Selection| {
            let s = store
                .load(
                    &sources(std::slice::from_ref(&path)),
                    "",
                    Quantization::None,
                    &selection,
                    me(1),
                    &mut |_, _, _| {},
                )
                .unwrap();
            (s.model.id.clone(), s.existed)
        };
        let (ab, existed) = load(only(&["a", "b"]));
        assert!(!existed);
        assert_eq!(load(only(&["b", "a"])), (ab.clone(), true));
        let (a, _) = load(only(&["a"]));
        let (b, _) = load(only(&["b"]));
        let (all, _) = load(Selection::All);
        let ids = HashSet::from([&ab, &a, &b, &all]);
        assert_eq!(ids.len(), 4, "{ab} {a} {b} {all}");
        assert_eq!(store.models().len(), 4);
    }

    /// A name none of the files holds is refused, naming it and the first files; so is a
    /// pre-quantized weight's scale (it is stored with its weight).
    #[test]
    fn a_selection_of_a_tensor_not_loadable_by_itself_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(HostQuota::default());
        let paths: Vec<_> = (0..5)
            .map(|i| {
                u8_file(
                    dir.path(),
                    &format!("{i}.safetensors"),
                    &[(&format!("t{i}"), vec![1; 8])],
                )
            })
            .collect();
        let load = |paths: &[std::path::PathBuf], names: &[&str]| {
            let err = store
                .load(
                    &sources(paths),
                    "",
                    Quantization::None,
                    &only(names),
                    me(1),
                    &mut |_, _, _| {},
                )
                .unwrap_err();
            err.to_string()
        };
        let d = dir.path().display();
        assert_eq!(
            load(&paths, &["t4", "x"]),
            format!(
                "tensors: 'x' is in none of the files ({d}/0.safetensors, {d}/1.safetensors, \
                 {d}/2.safetensors and 2 more)"
            )
        );
        assert_eq!(
            load(&paths[..1], &["t1"]),
            format!("tensors: 't1' is in none of the files ({d}/0.safetensors)")
        );
        // musubi: an fp8 weight with a per-tensor scale, and a plain tensor.
        let (w, scale, plain) = ([0x38u8; 32], 0.5f32.to_le_bytes(), [3u8; 4]);
        let fp8 = [
            (
                "l.weight",
                ::safetensors::Dtype::F8_E4M3,
                vec![4, 8],
                &w[..],
            ),
            (
                "l.scale_weight",
                ::safetensors::Dtype::F32,
                vec![],
                &scale[..],
            ),
            ("p", ::safetensors::Dtype::U8, vec![4], &plain[..]),
        ]
        .map(|(name, dtype, shape, data)| {
            let view = ::safetensors::tensor::TensorView::new(dtype, shape, data);
            (name, view.unwrap())
        });
        let musubi = dir.path().join("musubi.safetensors");
        ::safetensors::serialize_to_file(fp8, None, &musubi).unwrap();
        let musubi = [musubi];
        assert_eq!(
            load(&musubi, &["l.scale_weight"]),
            "tensors: 'l.scale_weight' is the scale of pre-quantized weight 'l.weight', loaded \
             with it: name the weight"
        );
        assert_eq!(store.models().len(), 0);
        // The weight brings its scale; the plain tensor stays out.
        let stored = store
            .load(
                &sources(&musubi),
                "",
                Quantization::None,
                &only(&["l.weight"]),
                me(1),
                &mut |_, _, _| {},
            )
            .unwrap();
        let names: Vec<&str> = stored
            .model
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["l.weight"]);
        assert_eq!(stored.phases.input_bytes, 32 + 4);
        assert!(stored.model.tensors[0].quantized.is_some());
    }
}
