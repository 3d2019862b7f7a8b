//! Loading safetensors from files the client opened and passed: headers read and checked,
//! tensors placed page-aligned in a new arena, copied in with positioned reads (progress
//! reported as it goes), pinned, then inserted, where a concurrent load of the same files that
//! finished first wins and this one becomes a reference to it. No lock is held while reading.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use rustix::fs::FileType;

use super::safetensors::{self, TensorEntry};
use super::{Model, ModelSource, Store, StoreError, StoredTensor, TENSOR_ALIGN, metadata_bytes};
use crate::mem::align_up;

/// Load progress is reported at least this often (in bytes).
const PROGRESS_STEP: u64 = 64 << 20;

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

/// Each tensor, the file it is read from and its offset in the arena.
type Plan<'a> = Vec<(&'a Opened<'a>, TensorEntry, u64)>;

impl Store {
    /// Loads safetensors from `sources` (blocking; run it off the async runtime). Returns the
    /// model and whether it was already in the store.
    pub fn load(
        &self,
        sources: &[LoadSource],
        name: &str,
        uid: u32,
        progress: Progress<'_>,
    ) -> Result<(Arc<Model>, bool), StoreError> {
        let (id, opened) = identity(sources)?;
        let last = Path::new(sources.last().map_or("", |s| s.name.as_str()));
        if let Some(model) = self.add_ref(&id, uid) {
            let total = model.total_bytes;
            progress(total, total, last);
            return Ok((model, true));
        }
        let plan = self.plan_load(&opened)?;
        let total: u64 = plan.iter().map(|(_, e, _)| e.nbytes).sum();
        let arena_len = align_up(
            plan.last().map_or(0, |(_, e, off)| off + e.nbytes),
            TENSOR_ALIGN,
        );
        let name = if name.is_empty() {
            default_name(sources)
        } else {
            name.to_string()
        };
        let metadata = metadata_bytes(
            &name,
            plan.iter().map(|(_, e, _)| (&*e.name, e.shape.len())),
        );
        let reserved = self.reserve(uid, arena_len + metadata, false, "model")?;
        let mut segment =
            self.shm
                .create("model", arena_len)
                .map_err(|source| StoreError::Arena {
                    bytes: arena_len,
                    source,
                })?;
        let arena = segment.bytes_mut().expect("a new segment is writable");
        copy_tensors(&plan, arena, total, progress)?;
        let tensors: Vec<StoredTensor> = plan
            .into_iter()
            .map(|(_, e, offset)| StoredTensor {
                name: e.name,
                dtype: e.dtype,
                shape: e.shape,
                offset,
                nbytes: e.nbytes,
            })
            .collect();
        progress(total, total, Path::new("page-locking host memory"));
        let arena = self.pin(segment, &tensors)?;
        let model = Model::new(id, name, ModelSource::File, tensors, arena);
        let loaded = self.insert_or_ref(Arc::new(model), uid);
        drop(reserved);
        Ok(loaded)
    }

    /// Reads every header, rejects duplicates and places each tensor in the future arena.
    fn plan_load<'a>(&self, files: &'a [Opened<'a>]) -> Result<Plan<'a>, StoreError> {
        let mut seen: HashMap<String, &str> = HashMap::new();
        let mut plan = Vec::new();
        let mut offset = 0u64;
        for opened in files {
            let path = opened.source.name.as_str();
            let mut reader = ReadAt {
                file: &opened.source.file,
                at: 0,
            };
            let header = safetensors::read_header(&mut reader, opened.len).map_err(|source| {
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
            for entry in header.tensors {
                if let Some(first) = seen.insert(entry.name.clone(), path) {
                    return Err(StoreError::DuplicateTensor {
                        name: entry.name,
                        first: first.to_string(),
                        second: path.to_string(),
                    });
                }
                offset = align_up(offset, TENSOR_ALIGN);
                let at = offset;
                offset += entry.nbytes;
                plan.push((opened, entry, at));
            }
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

/// Copies each tensor from its file into the arena with positioned reads: unlike a mapping of
/// the source, a file truncated under us is an error here, not a SIGBUS.
fn copy_tensors(
    plan: &Plan<'_>,
    arena: &mut [u8],
    total: u64,
    progress: Progress<'_>,
) -> Result<(), StoreError> {
    let mut done = 0u64;
    let mut reported = 0u64;
    for (opened, entry, offset) in plan {
        let path = opened.source.name.as_str();
        let mut at = 0u64;
        while at < entry.nbytes {
            let n = (entry.nbytes - at).min(PROGRESS_STEP);
            let dst = &mut arena[(offset + at) as usize..(offset + at + n) as usize];
            (opened.source.file)
                .read_exact_at(dst, entry.file_offset + at)
                .map_err(|source| StoreError::Io {
                    path: path.to_string(),
                    source,
                })?;
            at += n;
            done += n;
            if done - reported >= PROGRESS_STEP {
                reported = done;
                progress(done, total, Path::new(path));
            }
        }
    }
    if let Some((opened, _, _)) = plan.last() {
        progress(done, total, Path::new(&opened.source.name));
    }
    Ok(())
}

/// The model id of these files, and their lengths. The same files unchanged give the same id:
/// (device, inode, size, mtime, ctime) of each. The ctime catches a file rewritten in place
/// with its mtime set back (anyone who can write a file can set its mtime; only the kernel sets
/// its ctime).
fn identity(sources: &[LoadSource]) -> Result<(String, Vec<Opened<'_>>), StoreError> {
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
                let loaded = store.load(&sources(&[path]), "", 1, &mut progress);
                (loaded, waited)
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
        let err = store.load(&[source], "", 1, &mut |_, _, _| {}).unwrap_err();
        assert_eq!(
            err.to_string(),
            "/models/dir: not a regular file: only regular files can be loaded"
        );
    }
}
