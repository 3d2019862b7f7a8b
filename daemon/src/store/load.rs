//! Loading safetensors sources: headers read and checked, tensors placed page-aligned in a new
//! arena, copied in with positioned reads (progress reported as it goes), then pinned.

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::safetensors::{self, TensorEntry};
use super::sources::resolve_sources;
use super::{Model, ModelSource, Store, StoreError, StoredTensor, TENSOR_ALIGN};
use crate::mem::align_up;
use crate::mem::shm::{ShmSegment, Writer};

/// Load progress is reported at least this often (in bytes).
const PROGRESS_STEP: u64 = 64 << 20;

/// Load progress as (bytes done, bytes total, current file).
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64, &Path);

impl Store {
    /// Loads safetensors sources (blocking; run it off the async runtime). Returns the model and
    /// whether it was already in the store.
    pub fn load(
        &self,
        paths: &[PathBuf],
        name: &str,
        uid: u32,
        progress: Progress<'_>,
    ) -> Result<(Arc<Model>, bool), StoreError> {
        let files = resolve_sources(paths)?;
        let _serial = self.load_lock.lock().unwrap_or_else(|p| p.into_inner());
        let id = file_identity(&files)?;
        if let Some(model) = self.add_ref(&id, uid) {
            let total = model.total_bytes;
            progress(total, total, files.last().map_or(Path::new(""), |p| p));
            return Ok((model, true));
        }
        let plan = self.plan_load(&files)?;
        let total: u64 = plan.iter().map(|(_, e, _)| e.nbytes).sum();
        let arena_len = align_up(
            plan.last().map_or(0, |(_, e, off)| off + e.nbytes),
            TENSOR_ALIGN,
        );
        let reserved = self.reserve(uid, arena_len, false, "model")?;
        let mut segment = self
            .shm
            .create("model", arena_len, Writer::Daemon)
            .map_err(|source| StoreError::Arena {
                bytes: arena_len,
                source,
            })?;
        copy_tensors(&plan, &mut segment, total, progress)?;
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
        let name = if name.is_empty() {
            default_name(&files)
        } else {
            name.to_string()
        };
        progress(total, total, Path::new("page-locking host memory"));
        let arena = self.pin(segment, &tensors)?;
        let model = Arc::new(Model::new(
            id.clone(),
            name,
            ModelSource::File,
            tensors,
            arena,
        ));
        self.insert(model.clone(), uid);
        drop(reserved);
        Ok((model, false))
    }

    /// Reads every header, rejects duplicates and places each tensor in the future arena.
    fn plan_load(&self, files: &[PathBuf]) -> Result<Vec<(PathBuf, TensorEntry, u64)>, StoreError> {
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        let mut plan = Vec::new();
        let mut offset = 0u64;
        for path in files {
            let io = |source| StoreError::Io {
                path: path.clone(),
                source,
            };
            let mut file = std::fs::File::open(path).map_err(io)?;
            let len = file.metadata().map_err(io)?.len();
            let header =
                safetensors::read_header(&mut file, len).map_err(|source| StoreError::Header {
                    path: path.clone(),
                    source,
                })?;
            let count = (seen.len() + header.tensors.len()) as u64;
            if count > u64::from(self.limits.max_tensors) {
                return Err(StoreError::TooManyTensors {
                    count,
                    limit: self.limits.max_tensors,
                });
            }
            for entry in header.tensors {
                if let Some(first) = seen.insert(entry.name.clone(), path.clone()) {
                    return Err(StoreError::DuplicateTensor {
                        name: entry.name,
                        first,
                        second: path.clone(),
                    });
                }
                offset = align_up(offset, TENSOR_ALIGN);
                let at = offset;
                offset += entry.nbytes;
                plan.push((path.clone(), entry, at));
            }
        }
        Ok(plan)
    }
}

/// Copies each tensor from its file into the arena with positioned reads: unlike a mapping of
/// the source, a file truncated under us is an error here, not a SIGBUS.
fn copy_tensors(
    plan: &[(PathBuf, TensorEntry, u64)],
    segment: &mut ShmSegment,
    total: u64,
    progress: Progress<'_>,
) -> Result<(), StoreError> {
    let mut done = 0u64;
    let mut reported = 0u64;
    let mut open: Option<(PathBuf, std::fs::File)> = None;
    let arena = segment.bytes_mut();
    for (path, entry, offset) in plan {
        if open.as_ref().is_none_or(|(p, _)| p != path) {
            let file = std::fs::File::open(path).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            open = Some((path.clone(), file));
        }
        let (_, file) = open.as_ref().expect("opened above");
        let mut at = 0u64;
        while at < entry.nbytes {
            let n = (entry.nbytes - at).min(PROGRESS_STEP);
            let dst = &mut arena[(offset + at) as usize..(offset + at + n) as usize];
            file.read_exact_at(dst, entry.file_offset + at)
                .map_err(|source| StoreError::Io {
                    path: path.clone(),
                    source,
                })?;
            at += n;
            done += n;
            if done - reported >= PROGRESS_STEP {
                reported = done;
                progress(done, total, path);
            }
        }
    }
    if let Some((path, _)) = &open {
        progress(done, total, path);
    }
    Ok(())
}

/// Same files (device, inode, size, mtime) give the same id.
fn file_identity(files: &[PathBuf]) -> Result<String, StoreError> {
    let mut hasher = blake3::Hasher::new();
    for path in files {
        let meta = std::fs::metadata(path).map_err(|source| StoreError::Io {
            path: path.clone(),
            source,
        })?;
        let key = format!(
            "{}:{}:{}:{}.{}\n",
            meta.dev(),
            meta.ino(),
            meta.len(),
            meta.mtime(),
            meta.mtime_nsec()
        );
        hasher.update(key.as_bytes());
    }
    Ok(format!("m-{}", &hasher.finalize().to_hex()[..16]))
}

fn default_name(files: &[PathBuf]) -> String {
    let first = files.first().map(PathBuf::as_path).unwrap_or(Path::new(""));
    let base = if files.len() > 1 {
        first.parent().unwrap_or(first)
    } else {
        first
    };
    base.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}
