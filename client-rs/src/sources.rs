//! Turns what the user names (a file, a sharded index, a directory) into the safetensors files
//! that make one model, and opens them to pass to the daemon: the daemon never opens a path a
//! client names, so the resolution it used to do happens here, with its rules and messages.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

use crate::handoff::{self, MAX_FDS};

/// Index files are JSON with a `weight_map`; a huge one is not an index.
const MAX_INDEX_BYTES: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("paths: no file given")]
    Empty,
    #[error("no such file: {0}")]
    NotFound(PathBuf),
    #[error("{0}: a relative path (give an absolute one: the model records where its files are)")]
    Relative(PathBuf),
    #[error("{0}: not a .safetensors file, a *.safetensors.index.json or a directory")]
    Unsupported(PathBuf),
    #[error("{0}: directory holds no .safetensors file")]
    EmptyDirectory(PathBuf),
    #[error("{path}: invalid index: {reason}")]
    BadIndex { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {kind}, not a regular file: only regular files can be loaded")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error(
        "{0} files, more than the {MAX_FDS} one load can pass (the kernel's limit of file \
         descriptors per message): make the model of fewer, larger shards"
    )]
    TooMany(usize),
}

impl SourceError {
    /// The status code the daemon gave for this error when it resolved paths itself.
    pub fn code(&self) -> tonic::Code {
        match self {
            SourceError::NotFound(_) => tonic::Code::NotFound,
            _ => tonic::Code::InvalidArgument,
        }
    }
}

/// A safetensors file of a model, opened: its path is what the daemon shows.
pub struct OpenedSource {
    pub path: PathBuf,
    pub fd: OwnedFd,
}

/// Resolves `paths` and opens each file read-only, at most [`MAX_FDS`] of them.
pub fn open_sources(paths: &[PathBuf]) -> Result<Vec<OpenedSource>, SourceError> {
    let files = resolve_sources(paths)?;
    if files.len() > MAX_FDS {
        return Err(SourceError::TooMany(files.len()));
    }
    files.into_iter().map(open_source).collect()
}

/// Opens a resolved file without following a final symlink and without blocking (a FIFO
/// would), then checks it is a regular file. Links to the file (a Hugging Face cache's
/// snapshot links to its blobs) are resolved first, as the daemon's resolution followed them.
fn open_source(path: PathBuf) -> Result<OpenedSource, SourceError> {
    let io = |path: &Path, e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => SourceError::NotFound(path.to_path_buf()),
        _ => SourceError::Io {
            path: path.to_path_buf(),
            source: e,
        },
    };
    let target = std::fs::canonicalize(&path).map_err(|e| io(&path, e))?;
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let fd = rustix::fs::open(&target, flags, Mode::empty()).map_err(|e| io(&path, e.into()))?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| io(&path, e.into()))?;
    let kind = FileType::from_raw_mode(stat.st_mode);
    if kind != FileType::RegularFile {
        let kind = handoff::describe(kind);
        return Err(SourceError::NotRegular { path, kind });
    }
    Ok(OpenedSource { path, fd })
}

/// The safetensors files named by `paths`, in a stable order, each once.
pub fn resolve_sources(paths: &[PathBuf]) -> Result<Vec<PathBuf>, SourceError> {
    if paths.is_empty() {
        return Err(SourceError::Empty);
    }
    let mut files = Vec::new();
    for path in paths {
        if !path.is_absolute() {
            return Err(SourceError::Relative(path.clone()));
        }
        let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => SourceError::NotFound(path.clone()),
            _ => SourceError::Io {
                path: path.clone(),
                source: e,
            },
        })?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        if meta.is_dir() {
            files.extend(directory(path)?);
        } else if name.ends_with(".safetensors.index.json") {
            files.extend(index(path)?);
        } else if name.ends_with(".safetensors") {
            files.push(path.clone());
        } else {
            return Err(SourceError::Unsupported(path.clone()));
        }
    }
    let mut seen = BTreeSet::new();
    files.retain(|f| seen.insert(f.clone()));
    Ok(files)
}

fn directory(dir: &Path) -> Result<Vec<PathBuf>, SourceError> {
    let io = |source| SourceError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    if files.is_empty() {
        return Err(SourceError::EmptyDirectory(dir.to_path_buf()));
    }
    files.sort();
    Ok(files)
}

fn index(path: &Path) -> Result<Vec<PathBuf>, SourceError> {
    let bad = |reason: String| SourceError::BadIndex {
        path: path.to_path_buf(),
        reason,
    };
    let len = std::fs::metadata(path)
        .map_err(|source| SourceError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    if len > MAX_INDEX_BYTES {
        return Err(bad(format!(
            "{len} bytes, more than the limit of {MAX_INDEX_BYTES}"
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|source| SourceError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let dir = path.parent().unwrap_or(Path::new("/"));
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map[\"{tensor}\"] is not a string")))?;
        if file.contains('/') || file == ".." {
            return Err(bad(format!(
                "weight_map[\"{tensor}\"] = \"{file}\" leaves the index's directory"
            )));
        }
        shards.insert(dir.join(file));
    }
    if shards.is_empty() {
        return Err(bad("empty weight_map".into()));
    }
    for shard in &shards {
        if !shard.is_file() {
            return Err(SourceError::NotFound(shard.clone()));
        }
    }
    Ok(shards.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[test]
    fn resolves_files_indexes_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for f in ["b.safetensors", "a.safetensors", "notes.txt"] {
            std::fs::write(d.join(f), b"").unwrap();
        }
        std::fs::write(
            d.join("m.safetensors.index.json"),
            r#"{"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}"#,
        )
        .unwrap();
        let both = vec![d.join("a.safetensors"), d.join("b.safetensors")];
        assert_eq!(resolve_sources(&[d.to_path_buf()]).unwrap(), both);
        let index = d.join("m.safetensors.index.json");
        assert_eq!(resolve_sources(&[index]).unwrap(), both);
        let one = vec![d.join("b.safetensors")];
        assert_eq!(resolve_sources(&one).unwrap(), one);
    }

    #[test]
    fn a_directory_gives_its_safetensors_sorted() {
        // Made out of order, so that no directory listing order happens to be sorted.
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for name in ["c", "a", "d", "b"] {
            std::fs::write(d.join(format!("{name}.safetensors")), b"").unwrap();
        }
        std::fs::write(d.join("x.safetensors.index.json"), b"{}").unwrap();
        std::fs::create_dir(d.join("sub.safetensors")).unwrap();
        let want: Vec<PathBuf> = ["a", "b", "c", "d"]
            .iter()
            .map(|n| d.join(format!("{n}.safetensors")))
            .collect();
        assert_eq!(resolve_sources(&[d.to_path_buf()]).unwrap(), want);
    }

    #[test]
    fn rejects_bad_sources() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("notes.txt"), b"").unwrap();
        std::fs::write(
            d.join("bad.safetensors.index.json"),
            r#"{"weight_map": {"x": "missing.safetensors"}}"#,
        )
        .unwrap();
        std::fs::write(
            d.join("evil.safetensors.index.json"),
            r#"{"weight_map": {"x": "../etc/passwd"}}"#,
        )
        .unwrap();
        let err = |p: PathBuf| resolve_sources(&[p]).unwrap_err().to_string();
        assert!(matches!(resolve_sources(&[]), Err(SourceError::Empty)));
        assert!(err(PathBuf::from("rel.safetensors")).contains("a relative path"));
        assert_eq!(
            err(d.join("nope.safetensors")),
            format!("no such file: {}", d.join("nope.safetensors").display())
        );
        assert!(err(d.join("notes.txt")).contains("not a .safetensors file"));
        let missing = err(d.join("bad.safetensors.index.json"));
        assert!(
            missing.starts_with("no such file: ") && missing.ends_with("missing.safetensors"),
            "{missing}"
        );
        let evil = err(d.join("evil.safetensors.index.json"));
        assert!(evil.contains("leaves the index's directory"), "{evil}");
        let empty = tempfile::tempdir().unwrap();
        assert!(err(empty.path().to_path_buf()).contains("holds no .safetensors file"));
    }

    #[test]
    fn opens_regular_files_through_links_and_names_them_as_given() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("blob"), b"weights").unwrap();
        std::os::unix::fs::symlink(d.join("blob"), d.join("model.safetensors")).unwrap();
        let opened = open_sources(&[d.join("model.safetensors")]).unwrap();
        assert_eq!(opened.len(), 1);
        assert_eq!(opened[0].path, d.join("model.safetensors"));
        let mut text = String::new();
        let fd = opened.into_iter().next().unwrap().fd;
        std::fs::File::from(fd).read_to_string(&mut text).unwrap();
        assert_eq!(text, "weights");
    }

    #[test]
    fn refuses_what_is_not_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe.safetensors");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, FileType::Fifo, Mode::RUSR, 0).unwrap();
        let err = open_sources(std::slice::from_ref(&fifo))
            .err()
            .map(|e| e.to_string());
        let want = format!(
            "{}: a FIFO, not a regular file: only regular files can be loaded",
            fifo.display()
        );
        assert_eq!(err, Some(want));
    }

    #[test]
    fn refuses_more_files_than_one_load_can_pass() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..=MAX_FDS {
            std::fs::write(dir.path().join(format!("{i:03}.safetensors")), b"").unwrap();
        }
        let err = open_sources(&[dir.path().to_path_buf()])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.starts_with("254 files, more than the 253")),
            "{err:?}"
        );
    }
}
