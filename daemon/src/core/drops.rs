//! Files passed through the handoff socket (`PUT`), kept under a token until the LoadModel
//! that names it. A token is 128 random bits, good once, for 60 s, and only for the uid that
//! passed the files; a uid has at most 16 waiting. Expired ones are closed on each put.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The name a passed file is shown by (in status, progress and errors): the path its client
/// gave, when that path names this very file (same device and inode: the daemon stats the
/// path, it never opens it); otherwise the file's own path as the kernel keeps it for the fd
/// (`/proc/self/fd`), so that a client cannot show its file as `/etc/shadow`; and when neither
/// is known, the client's path marked as its claim. Blocking (a stat): run it off the runtime.
pub fn shown_name(claimed: &str, file: &std::fs::File) -> String {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let same = |path: &str| {
        let (Ok(named), Ok(passed)) = (std::fs::metadata(path), file.metadata()) else {
            return false;
        };
        (named.dev(), named.ino()) == (passed.dev(), passed.ino())
    };
    if claimed.starts_with('/') && same(claimed) {
        return claimed.to_string();
    }
    match std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) {
        Ok(real) => real.display().to_string(),
        Err(_) => format!("{claimed} (as its client named it)"),
    }
}

/// How long passed files wait for their LoadModel.
pub const TOKEN_TTL: Duration = Duration::from_secs(60);
/// Tokens one uid may have waiting at once.
pub const MAX_DROPS_PER_UID: usize = 16;
/// Files waiting, all uids together: each is an fd of the daemon's.
pub const MAX_WAITING_FILES: usize = 8192;

/// 128 random bits from the kernel (getrandom(2)) as 32 lowercase hex characters: a token or
/// a secret.
pub fn random_secret() -> String {
    let mut bytes = [0u8; 16];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            // Reads of up to 256 bytes from an initialised pool always succeed (random(7)); a
            // kernel with memfds (3.17) has the call.
            Err(e) => panic!("getrandom(2) failed: {e}"),
        }
    }
    format!("{:032x}", u128::from_le_bytes(bytes))
}

/// Why a `PUT` was refused (sent back on the handoff socket).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DropError {
    #[error(
        "uid {uid} already has {MAX_DROPS_PER_UID} sets of files waiting for a LoadModel (the \
         limit per uid): use those tokens, or let them expire ({}s)",
        TOKEN_TTL.as_secs()
    )]
    TooMany { uid: u32 },
    #[error(
        "the daemon already holds {waiting} files waiting for a LoadModel, and {limit} at most: \
         retry once some are loaded or expired ({}s)",
        TOKEN_TTL.as_secs()
    )]
    TooManyFiles { waiting: usize, limit: usize },
}

/// Why LoadModel's `fd_token` was refused. "Unknown" does not say whether the token exists for
/// another uid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FdTokenError {
    #[error(
        "fd_token: unknown, expired or already used (a token is good for one LoadModel by the \
         uid that passed the files, within {}s)",
        TOKEN_TTL.as_secs()
    )]
    Unknown,
    #[error(
        "fd_token: it names {files} files but paths has {paths} entries (one fd per path, in \
         the same order)"
    )]
    Count { files: usize, paths: usize },
}

struct Drop {
    uid: u32,
    fds: Vec<OwnedFd>,
    created: Instant,
}

/// The waiting files, by token.
pub struct FdDrops {
    drops: Mutex<HashMap<String, Drop>>,
    max_files: usize,
}

impl Default for FdDrops {
    fn default() -> Self {
        FdDrops::with_limit(MAX_WAITING_FILES)
    }
}

impl FdDrops {
    /// At most `max_files` files waiting, all uids together.
    pub fn with_limit(max_files: usize) -> FdDrops {
        FdDrops {
            drops: Mutex::default(),
            max_files,
        }
    }

    /// Keeps `fds` for `uid`; returns their token.
    pub fn put(&self, uid: u32, fds: Vec<OwnedFd>) -> Result<String, DropError> {
        self.put_at(uid, fds, Instant::now())
    }

    fn put_at(&self, uid: u32, fds: Vec<OwnedFd>, now: Instant) -> Result<String, DropError> {
        let mut drops = self.drops.lock().unwrap_or_else(|p| p.into_inner());
        drops.retain(|_, d| now.duration_since(d.created) < TOKEN_TTL);
        if drops.values().filter(|d| d.uid == uid).count() >= MAX_DROPS_PER_UID {
            return Err(DropError::TooMany { uid });
        }
        let waiting: usize = drops.values().map(|d| d.fds.len()).sum();
        if waiting + fds.len() > self.max_files {
            let limit = self.max_files;
            return Err(DropError::TooManyFiles { waiting, limit });
        }
        let token = random_secret();
        let created = now;
        drops.insert(token.clone(), Drop { uid, fds, created });
        Ok(token)
    }

    /// The files behind `token`, once, for the uid that passed them; there must be one per
    /// path. A token of another uid stays where it is.
    pub fn take(&self, token: &str, uid: u32, paths: usize) -> Result<Vec<OwnedFd>, FdTokenError> {
        self.take_at(token, uid, paths, Instant::now())
    }

    fn take_at(
        &self,
        token: &str,
        uid: u32,
        paths: usize,
        now: Instant,
    ) -> Result<Vec<OwnedFd>, FdTokenError> {
        let mut drops = self.drops.lock().unwrap_or_else(|p| p.into_inner());
        match drops.get(token) {
            Some(d) if d.uid == uid => {}
            _ => return Err(FdTokenError::Unknown),
        }
        let found = drops.remove(token).expect("present");
        drop(drops);
        if now.duration_since(found.created) >= TOKEN_TTL {
            return Err(FdTokenError::Unknown);
        }
        if found.fds.len() != paths {
            return Err(FdTokenError::Count {
                files: found.fds.len(),
                paths,
            });
        }
        Ok(found.fds)
    }

    /// Tokens waiting now (expired ones included until the next put).
    pub fn waiting(&self) -> usize {
        self.drops.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    /// A path that names the passed file (directly or through a link) is shown as given; one
    /// that names another file, or nothing, gives way to the file's own path.
    #[test]
    fn a_file_is_shown_by_a_path_that_names_it_or_by_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("own.safetensors");
        std::fs::write(&real, b"x").unwrap();
        let link = dir.path().join("link.safetensors");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let other = dir.path().join("other.safetensors");
        std::fs::write(&other, b"y").unwrap();
        let file = std::fs::File::open(&real).unwrap();
        let own = real.display().to_string();
        let shown = |claimed: &std::path::Path| super::shown_name(claimed.to_str().unwrap(), &file);
        let cases = [
            (real.clone(), own.clone()),
            (link.clone(), link.display().to_string()),
            (other, own.clone()),
            ("/etc/shadow".into(), own.clone()),
            ("relative/own.safetensors".into(), own.clone()),
            (dir.path().join("missing"), own.clone()),
        ];
        let failed: Vec<String> = (cases.iter())
            .filter(|(claimed, want)| shown(claimed) != *want)
            .map(|(claimed, want)| format!("{claimed:?}: want {want}, got {}", shown(claimed)))
            .collect();
        assert!(failed.is_empty(), "{failed:#?}");
    }

    use super::*;

    fn fds(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| OwnedFd::from(std::fs::File::open("/dev/null").unwrap()))
            .collect()
    }

    #[test]
    fn a_token_is_single_use_for_its_uid_and_one_fd_per_path() {
        let drops = FdDrops::default();
        let token = drops.put(7, fds(2)).unwrap();
        assert!(token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(drops.put(7, fds(1)).unwrap(), token, "tokens are random");
        assert_eq!(drops.take(&token, 8, 2).unwrap_err(), FdTokenError::Unknown);
        assert_eq!(
            drops.take(&token, 7, 2).unwrap().len(),
            2,
            "another uid left it"
        );
        assert_eq!(drops.take(&token, 7, 2).unwrap_err(), FdTokenError::Unknown);
        let token = drops.put(7, fds(2)).unwrap();
        assert_eq!(
            drops.take(&token, 7, 3).unwrap_err().to_string(),
            "fd_token: it names 2 files but paths has 3 entries (one fd per path, in the same \
             order)"
        );
        assert_eq!(drops.take(&token, 7, 2).unwrap_err(), FdTokenError::Unknown);
        assert_eq!(
            FdTokenError::Unknown.to_string(),
            "fd_token: unknown, expired or already used (a token is good for one LoadModel by \
             the uid that passed the files, within 60s)"
        );
    }

    #[test]
    fn tokens_expire_and_each_uid_has_at_most_sixteen() {
        let drops = FdDrops::default();
        let start = Instant::now();
        let old = drops.put_at(1, fds(1), start).unwrap();
        let late = start + TOKEN_TTL;
        assert_eq!(
            drops.take_at(&old, 1, 1, late).unwrap_err(),
            FdTokenError::Unknown
        );
        for _ in 0..MAX_DROPS_PER_UID {
            drops.put_at(1, fds(1), start).unwrap();
        }
        assert_eq!(
            drops.put_at(1, fds(1), start).unwrap_err().to_string(),
            "uid 1 already has 16 sets of files waiting for a LoadModel (the limit per uid): use \
             those tokens, or let them expire (60s)"
        );
        drops.put_at(2, fds(1), start).unwrap();
        // A minute later the sixteen have expired: they are closed on the next put.
        drops.put_at(1, fds(1), late).unwrap();
        assert_eq!(drops.waiting(), 1);
    }

    #[test]
    fn the_files_waiting_are_bounded_for_the_whole_daemon() {
        let drops = FdDrops::with_limit(10);
        for uid in 0..3 {
            drops.put(uid, fds(3)).unwrap();
        }
        assert_eq!(
            drops.put(4, fds(2)).unwrap_err().to_string(),
            "the daemon already holds 9 files waiting for a LoadModel, and 10 at most: retry \
             once some are loaded or expired (60s)"
        );
        drops.put(4, fds(1)).unwrap();
    }
}
