//! The handoff socket: file descriptors passed between clients and the daemon with
//! `SCM_RIGHTS`, next to the gRPC socket (at its path + `.fd`). Both halves live here, so that
//! the wire format is written once: the client's [`put_fds`] and [`get_fd`], and the daemon's
//! half of one connection, an [`Exchange`] (its request, then one reply).
//!
//! One request per connection, one ASCII line each way, each line at most 4096 bytes:
//! ```text
//! "PUT\n" + SCM_RIGHTS(1..=253 fds)   ->  "OK <token>\n"                 | "ERR <message>\n"
//! "GET <secret>\n"                    ->  "OK <size>\n" + SCM_RIGHTS(fd)  | "ERR <message>\n"
//! ```
//! After its reply the daemon closes its copies of the fds it passed, then the connection;
//! `get_fd` returns at that close, so that a region's charge ends when its client lets go.
//! Tokens and secrets are 32 lowercase hex characters. Every read and write of an exchange is
//! bounded by one 5 s deadline, so a peer that stalls is cut instead of holding a thread. The
//! calls block: async callers run them in `spawn_blocking`.
#![forbid(unsafe_code)]

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{FileType, OFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::socket::ResolvedSocket;

/// The most fds one `SCM_RIGHTS` message can carry (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;
/// The longest line either side sends, `\n` included.
pub const MAX_LINE: usize = 4096;
/// The bound on one exchange.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// Length of a token or secret: 128 random bits in lowercase hex.
pub const SECRET_LEN: usize = 32;

/// Where the daemon listens for handoffs: the gRPC socket's path + `.fd`.
pub fn handoff_path(socket: &Path) -> PathBuf {
    let mut path = socket.as_os_str().to_owned();
    path.push(".fd");
    PathBuf::from(path)
}

/// The handoff socket of the daemon at `socket`, checked as that socket is: a found one's
/// peer must be this user, root or the system socket's owner; a named one's may also be the
/// owner of the socket file ([`ResolvedSocket::check_peer`]).
///
/// [`ResolvedSocket::check_peer`]: crate::socket::ResolvedSocket::check_peer
pub fn handoff_socket(socket: &ResolvedSocket) -> ResolvedSocket {
    let path = handoff_path(&socket.path);
    ResolvedSocket {
        tried: vec![path.clone()],
        path,
        explicit: socket.explicit,
    }
}

/// True for a well-formed token or secret: 32 lowercase hex characters.
pub fn is_secret(s: &str) -> bool {
    s.len() == SECRET_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// Nothing accepts connections at the handoff socket.
    #[error(
        "cannot reach the daemon's handoff socket {}: {source} (a weightstream daemon of this \
         version listens there, next to its gRPC socket: is it running, and is it as new as \
         this client?)",
        path.display()
    )]
    Connect { path: PathBuf, source: io::Error },
    /// The exchange failed part way: a timeout, a reset connection.
    #[error("handoff socket: {0}")]
    Io(io::Error),
    /// The daemon answered `ERR`: its message.
    #[error("the daemon refused the handoff: {0}")]
    Refused(String),
    /// A request or reply that breaks the format, or files that cannot be passed; on the
    /// daemon's side this is the message to send back with [`reply_error`].
    #[error("{0}")]
    Invalid(String),
}

fn invalid(message: impl Into<String>) -> HandoffError {
    HandoffError::Invalid(message.into())
}

// --- client side -------------------------------------------------------------------------

/// Passes 1 to 253 open files to the daemon listening at `socket`, its handoff socket
/// ([`handoff_socket`] of the gRPC socket); returns the token that names them in one later
/// request (`LoadModelRequest.fd_token`).
pub fn put_fds(socket: &ResolvedSocket, fds: &[BorrowedFd<'_>]) -> Result<String, HandoffError> {
    if fds.is_empty() || fds.len() > MAX_FDS {
        return Err(invalid(format!(
            "{} files: one handoff passes 1 to {MAX_FDS} (the kernel's limit per message)",
            fds.len()
        )));
    }
    let (stream, deadline) = connect(socket)?;
    send_line(&stream, b"PUT\n", fds, deadline)?;
    let (token, _stray) = read_reply(&stream, deadline, 0)?;
    if !is_secret(&token) {
        return Err(invalid(format!(
            "the daemon's reply to PUT is not \"OK <token>\" with a token of {SECRET_LEN} \
             lowercase hex characters"
        )));
    }
    Ok(token)
}

/// Fetches from the handoff socket `socket` the fd that `secret` names
/// (`BeginUploadResponse.fd_secret`, `Region.fd_secret`) and the size of the region it holds.
pub fn get_fd(socket: &ResolvedSocket, secret: &str) -> Result<(OwnedFd, u64), HandoffError> {
    if !is_secret(secret) {
        return Err(invalid(format!(
            "fd_secret: {SECRET_LEN} lowercase hex characters expected, got {} characters",
            secret.len()
        )));
    }
    let (stream, deadline) = connect(socket)?;
    send_line(&stream, format!("GET {secret}\n").as_bytes(), &[], deadline)?;
    let (size, mut fds) = read_reply(&stream, deadline, 1)?;
    let size: u64 = size
        .parse()
        .map_err(|_| invalid("the daemon's reply to GET is not \"OK <size>\""))?;
    if fds.len() != 1 {
        return Err(invalid(format!(
            "the daemon's reply to GET carried {} files, expected 1",
            fds.len()
        )));
    }
    let fd = fds.remove(0);
    let actual = rustix::fs::fstat(&fd).map_err(|e| HandoffError::Io(e.into()))?;
    if (actual.st_size as u64) < size {
        return Err(invalid(format!(
            "the daemon passed a file of {} bytes for a region of {size}",
            actual.st_size
        )));
    }
    wait_for_close(&stream, deadline);
    Ok((fd, size))
}

/// Waits, by `deadline`, for the daemon to close the connection, which it does once it has
/// closed its own copy of the fd it passed: when [`get_fd`] returns, the fd's only copies are
/// the caller's, and the region's charge ends as soon as the caller lets go of it. Anything
/// else (bytes, a reset, the deadline) ends the wait too: the fd has arrived whole.
fn wait_for_close(stream: &UnixStream, deadline: Instant) {
    let mut byte = [0u8; 1];
    loop {
        let Ok(left) = remaining(deadline) else {
            return;
        };
        if stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match rustix::net::recv(stream, &mut byte, RecvFlags::empty()) {
            Err(rustix::io::Errno::INTR) => {}
            _ => return,
        }
    }
}

fn connect(socket: &ResolvedSocket) -> Result<(UnixStream, Instant), HandoffError> {
    let deadline = Instant::now() + TIMEOUT;
    let stream = UnixStream::connect(&socket.path).map_err(|source| HandoffError::Connect {
        path: socket.path.clone(),
        source,
    })?;
    check_daemon(socket, &stream)?;
    Ok((stream, deadline))
}

/// The handoff socket under the gRPC socket's rules: its directory, when it is the fallback
/// one, as [`ResolvedSocket::check_dir`] says; its peer as [`ResolvedSocket::check_peer`] says
/// of the gRPC socket, found or named ([`handoff_socket`]). Fds go out and come in here: never
/// to or from a place another user made.
///
/// [`ResolvedSocket::check_dir`]: crate::socket::ResolvedSocket::check_dir
/// [`ResolvedSocket::check_peer`]: crate::socket::ResolvedSocket::check_peer
fn check_daemon(socket: &ResolvedSocket, stream: &UnixStream) -> Result<(), HandoffError> {
    let caller = rustix::process::getuid().as_raw();
    let found = ResolvedSocket {
        explicit: false,
        ..socket.clone()
    };
    found.check_dir(caller).map_err(HandoffError::Invalid)?;
    let peer = crate::socket::peer_uid(stream).map_err(HandoffError::Io)?;
    let system = Path::new(crate::socket::SYSTEM_SOCKET);
    (socket.check_peer(peer, caller, system)).map_err(HandoffError::Invalid)
}

/// The text after `OK ` and the fds that came with it, or the daemon's `ERR` as an error.
fn read_reply(
    stream: &UnixStream,
    deadline: Instant,
    max_fds: usize,
) -> Result<(String, Vec<OwnedFd>), HandoffError> {
    let (line, fds) = read_line(stream, deadline, max_fds)?;
    let line = String::from_utf8(line).map_err(|_| invalid("the daemon's reply is not text"))?;
    if let Some(message) = line.strip_prefix("ERR ") {
        return Err(HandoffError::Refused(message.to_string()));
    }
    match line.strip_prefix("OK ") {
        Some(rest) => Ok((rest.to_string(), fds)),
        None => Err(invalid(
            "the daemon's reply is neither \"OK …\" nor \"ERR …\"",
        )),
    }
}

// --- daemon side -------------------------------------------------------------------------

/// A request read from the handoff socket.
#[derive(Debug)]
pub enum Request {
    /// Files to keep under a new token: each is a regular file open for reading.
    Put(Vec<OwnedFd>),
    /// The fd that a secret names, well-formed (32 lowercase hex characters).
    Get(String),
}

/// The daemon's half of one connection: its request, then one reply, all within one
/// [`TIMEOUT`] from [`Exchange::begin`] (a reply does not get a fresh 5 s of its own).
pub struct Exchange<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl<'a> Exchange<'a> {
    /// The exchange on an accepted `stream` begins: its [`TIMEOUT`] runs from now.
    pub fn begin(stream: &'a UnixStream) -> Exchange<'a> {
        Exchange::since(stream, Instant::now())
    }

    /// The exchange on `stream`, accepted at `accepted`: its [`TIMEOUT`] runs from then, so
    /// that a connection that waited for its turn gets no fresh 5 s of its own.
    pub fn since(stream: &'a UnixStream, accepted: Instant) -> Exchange<'a> {
        Exchange {
            stream,
            deadline: accepted + TIMEOUT,
        }
    }

    /// Reads the connection's one request. Received fds are close-on-exec; on any error those
    /// that arrived are closed, and the error's text is what to send back with
    /// [`Exchange::reply_error`].
    pub fn read_request(&self) -> Result<Request, HandoffError> {
        let (line, fds) = read_line(self.stream, self.deadline, MAX_FDS)?;
        parse_request(line, fds)
    }

    /// Answers a `PUT`: `OK <token>`.
    pub fn reply_token(&self, token: &str) -> Result<(), HandoffError> {
        debug_assert!(
            is_secret(token),
            "a token is {SECRET_LEN} lowercase hex characters"
        );
        let line = format!("OK {token}\n");
        send_line(self.stream, line.as_bytes(), &[], self.deadline)
    }

    /// Answers a `GET`: `OK <size>` with the fd.
    pub fn reply_fd(&self, fd: BorrowedFd<'_>, size: u64) -> Result<(), HandoffError> {
        let line = format!("OK {size}\n");
        send_line(self.stream, line.as_bytes(), &[fd], self.deadline)
    }

    /// Answers with `ERR <message>`: the message on one line, cut to fit [`MAX_LINE`].
    pub fn reply_error(&self, message: &str) -> Result<(), HandoffError> {
        let mut text: String = message
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let room = MAX_LINE - "ERR \n".len();
        if text.len() > room {
            let mut cut = room;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        let line = format!("ERR {text}\n");
        send_line(self.stream, line.as_bytes(), &[], self.deadline)
    }
}

/// A request's line and fds as a [`Request`], or the refusal to send back.
fn parse_request(line: Vec<u8>, fds: Vec<OwnedFd>) -> Result<Request, HandoffError> {
    if line == b"PUT" {
        if fds.is_empty() {
            return Err(invalid(format!(
                "PUT carries no files: send 1 to {MAX_FDS} fds in one SCM_RIGHTS message with \
                 the line"
            )));
        }
        for (index, fd) in fds.iter().enumerate() {
            check_file(index, fd.as_fd())?;
        }
        return Ok(Request::Put(fds));
    }
    if let Some(secret) = line.strip_prefix(b"GET ") {
        if !fds.is_empty() {
            return Err(invalid("GET carries no files"));
        }
        return match std::str::from_utf8(secret) {
            Ok(secret) if is_secret(secret) => Ok(Request::Get(secret.to_string())),
            _ => Err(invalid(format!(
                "GET: the secret must be {SECRET_LEN} lowercase hex characters"
            ))),
        };
    }
    Err(invalid(
        "unknown request: expected \"PUT\" or \"GET <secret>\"",
    ))
}

/// A passed file the daemon can read: a regular file (not a FIFO, socket, device or directory,
/// which could block or lie about their size), open for reading.
fn check_file(index: usize, fd: BorrowedFd<'_>) -> Result<(), HandoffError> {
    let stat = rustix::fs::fstat(fd).map_err(|e| invalid(format!("file {index}: fstat: {e}")))?;
    let kind = FileType::from_raw_mode(stat.st_mode);
    if kind != FileType::RegularFile {
        return Err(invalid(format!(
            "file {index} is {}: only regular files can be passed",
            describe(kind)
        )));
    }
    let flags = rustix::fs::fcntl_getfl(fd)
        .map_err(|e| invalid(format!("file {index}: fcntl(F_GETFL): {e}")))?;
    if flags.contains(OFlags::PATH) {
        return Err(invalid(format!(
            "file {index} is an O_PATH descriptor: open it for reading"
        )));
    }
    if flags & OFlags::ACCMODE == OFlags::WRONLY {
        return Err(invalid(format!(
            "file {index} is open write-only: open it for reading"
        )));
    }
    Ok(())
}

/// What a file is, for messages: "a FIFO", "a directory", ….
pub fn describe(kind: FileType) -> &'static str {
    match kind {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Symlink => "a symbolic link",
        FileType::Unknown => "a file of an unknown kind",
    }
}

// --- framing -----------------------------------------------------------------------------

/// What is left of the exchange's time; an error once the deadline has passed.
fn remaining(deadline: Instant) -> Result<Duration, HandoffError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timed_out());
    }
    Ok(left)
}

fn timed_out() -> HandoffError {
    HandoffError::Io(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("the exchange did not finish within {TIMEOUT:?}"),
    ))
}

/// An I/O error of the exchange: a socket timeout reads as the exchange's own.
fn io_error(e: rustix::io::Errno) -> HandoffError {
    if e == rustix::io::Errno::AGAIN {
        timed_out()
    } else {
        HandoffError::Io(e.into())
    }
}

/// Sends `line` whole, `fds` (if any) with its first byte, by `deadline`.
fn send_line(
    stream: &UnixStream,
    line: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Instant,
) -> Result<(), HandoffError> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(invalid(format!("{} fds do not fit one message", fds.len())));
    }
    let mut sent = 0;
    while sent < line.len() {
        stream
            .set_write_timeout(Some(remaining(deadline)?))
            .map_err(HandoffError::Io)?;
        let result = if sent == 0 {
            let iov = [IoSlice::new(line)];
            rustix::net::sendmsg(stream, &iov, &mut control, SendFlags::NOSIGNAL)
        } else {
            rustix::net::send(stream, &line[sent..], SendFlags::NOSIGNAL)
        };
        match result {
            Ok(n) => sent += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(io_error(e)),
        }
    }
    Ok(())
}

/// Reads one line (without its `\n`) and the fds that came with it, by `deadline`. The fds
/// must come in one `SCM_RIGHTS` message of at most `max_fds` (the buffer has room for a few
/// more: those are closed, and so are all of them when the kernel truncated the message); bytes after the line are an
/// error (one request per connection). Fds are received close-on-exec, and closed on error.
fn read_line(
    stream: &UnixStream,
    deadline: Instant,
    max_fds: usize,
) -> Result<(Vec<u8>, Vec<OwnedFd>), HandoffError> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(max_fds.max(1)))];
    let mut buf = [0u8; MAX_LINE];
    let mut line = Vec::new();
    let mut fds: Option<Vec<OwnedFd>> = None;
    loop {
        stream
            .set_read_timeout(Some(remaining(deadline)?))
            .map_err(HandoffError::Io)?;
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let room = MAX_LINE - line.len();
        let mut iov = [IoSliceMut::new(&mut buf[..room])];
        let received =
            match rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC) {
                Ok(r) => r,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(io_error(e)),
            };
        let mut arrived = Vec::new();
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(passed) = message {
                arrived.extend(passed);
            }
        }
        if received.flags.contains(ReturnFlags::CTRUNC) {
            return Err(invalid(format!(
                "the files did not all arrive (MSG_CTRUNC): at most {max_fds} in one \
                 SCM_RIGHTS message, and the receiver must have fds to spare"
            )));
        }
        if arrived.len() > max_fds {
            return Err(invalid(format!(
                "{} files arrived, at most {max_fds} expected",
                arrived.len()
            )));
        }
        if !arrived.is_empty() && fds.replace(arrived).is_some() {
            return Err(invalid("the files must come in one SCM_RIGHTS message"));
        }
        if received.bytes == 0 {
            return Err(invalid("the connection closed before the end of the line"));
        }
        line.extend_from_slice(&buf[..received.bytes]);
        if let Some(end) = line.iter().position(|&b| b == b'\n') {
            if end + 1 != line.len() {
                return Err(invalid("bytes after the line: one request per connection"));
            }
            line.pop();
            return Ok((line, fds.unwrap_or_default()));
        }
        if line.len() >= MAX_LINE {
            return Err(invalid(format!("the line is longer than {MAX_LINE} bytes")));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::{File, OpenOptions};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    use rustix::fs::Mode;

    use super::*;

    const SECRET: &str = "0123456789abcdef0123456789abcdef";

    fn message(result: Result<Request, HandoffError>) -> String {
        match result {
            Ok(request) => format!("accepted: {request:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// A listener at the handoff path of a socket in a fresh directory, and that path; `serve`
    /// handles the one connection it accepts, on a thread that gives up after [`TIMEOUT`]
    /// (so that a client that never connects fails its test instead of hanging it).
    fn serve<T: Send + 'static>(
        serve: impl FnOnce(UnixStream) -> T + Send + 'static,
    ) -> (
        tempfile::TempDir,
        ResolvedSocket,
        std::thread::JoinHandle<T>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let socket = handoff_socket(&ResolvedSocket::explicit(dir.path().join("ws.sock")));
        let path = socket.path.clone();
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let server = std::thread::spawn(move || {
            let deadline = Instant::now() + TIMEOUT;
            loop {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        return serve(stream);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        assert!(Instant::now() < deadline, "no client connected");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => panic!("accept: {e}"),
                }
            }
        });
        (dir, socket, server)
    }

    #[test]
    fn the_handoff_socket_is_checked_as_its_grpc_socket_is_found_or_named() {
        let grpc = Path::new("/run/weightstream/weightstream.sock");
        let found = ResolvedSocket {
            path: grpc.to_path_buf(),
            tried: vec![PathBuf::from("/tmp/a.sock"), grpc.to_path_buf()],
            explicit: false,
        };
        let fd = Path::new("/run/weightstream/weightstream.sock.fd");
        for (socket, named) in [(found, false), (ResolvedSocket::explicit(grpc), true)] {
            let handoff = handoff_socket(&socket);
            assert_eq!((handoff.path.as_path(), handoff.explicit), (fd, named));
            assert_eq!(handoff.tried, [fd]);
        }
    }

    #[test]
    fn handoff_path_appends_fd() {
        let path = handoff_path(Path::new("/run/weightstream/weightstream.sock"));
        assert_eq!(path, Path::new("/run/weightstream/weightstream.sock.fd"));
    }

    #[test]
    fn put_passes_regular_files_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let contents = ["first file", "second", "third and last"];
        let files: Vec<File> = contents
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let path = dir.path().join(format!("{i}.safetensors"));
                std::fs::write(&path, text).unwrap();
                File::open(path).unwrap()
            })
            .collect();
        let (_dir, socket, server) = serve(|stream| {
            let Request::Put(fds) = Exchange::begin(&stream).read_request().unwrap() else {
                panic!("expected PUT")
            };
            let read: Vec<String> = fds
                .into_iter()
                .map(|fd| {
                    let mut text = String::new();
                    File::from(fd).read_to_string(&mut text).unwrap();
                    text
                })
                .collect();
            Exchange::begin(&stream).reply_token(SECRET).unwrap();
            read
        });
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        assert_eq!(put_fds(&socket, &fds).unwrap(), SECRET);
        assert_eq!(server.join().unwrap(), contents);
    }

    #[test]
    fn put_refuses_what_is_not_a_readable_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let regular = d.join("model.safetensors");
        std::fs::write(&regular, b"weights").unwrap();
        let fifo = d.join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::RUSR | Mode::WUSR,
            0,
        )
        .unwrap();
        let open = |path: &Path, flags: OFlags| -> OwnedFd {
            rustix::fs::open(path, flags | OFlags::CLOEXEC, Mode::empty()).unwrap()
        };
        let (socket, _peer) = UnixStream::pair().unwrap();
        let cases: Vec<(OwnedFd, &str)> = vec![
            (
                open(&fifo, OFlags::RDONLY | OFlags::NONBLOCK),
                "file 1 is a FIFO: only regular files can be passed",
            ),
            (
                open(d, OFlags::RDONLY | OFlags::DIRECTORY),
                "file 1 is a directory: only regular files can be passed",
            ),
            (
                OwnedFd::from(socket),
                "file 1 is a socket: only regular files can be passed",
            ),
            (
                open(Path::new("/dev/null"), OFlags::RDONLY),
                "file 1 is a character device: only regular files can be passed",
            ),
            (
                open(&regular, OFlags::WRONLY),
                "file 1 is open write-only: open it for reading",
            ),
            (
                open(&regular, OFlags::PATH),
                "file 1 is an O_PATH descriptor: open it for reading",
            ),
        ];
        let good = File::open(&regular).unwrap();
        let mut failures = Vec::new();
        for (fd, want) in &cases {
            let (client, server) = UnixStream::pair().unwrap();
            let deadline = Instant::now() + TIMEOUT;
            send_line(&client, b"PUT\n", &[good.as_fd(), fd.as_fd()], deadline).unwrap();
            let got = message(Exchange::begin(&server).read_request());
            if got != *want {
                failures.push(format!("want {want:?}, got {got:?}"));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn get_passes_an_fd_and_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        std::fs::write(&path, b"region bytes").unwrap();
        let region = File::open(&path).unwrap();
        let (_dir, socket, server) = serve(move |stream| {
            let exchange = Exchange::begin(&stream);
            let request = exchange.read_request().unwrap();
            exchange.reply_fd(region.as_fd(), 12).unwrap();
            request
        });
        let (fd, size) = get_fd(&socket, SECRET).unwrap();
        let mut text = String::new();
        File::from(fd).read_to_string(&mut text).unwrap();
        assert_eq!((text.as_str(), size), ("region bytes", 12));
        assert!(matches!(server.join().unwrap(), Request::Get(s) if s == SECRET));
    }

    /// `get_fd` returns only once the daemon has closed the connection (after its own copy of
    /// the fd): a server that waits a second for word that the client returned, before it
    /// closes, never gets it.
    #[test]
    fn get_returns_once_the_daemon_has_closed_the_connection() {
        let region = tempfile::tempfile().unwrap();
        let (returned, heard) = std::sync::mpsc::channel::<()>();
        let (_dir, socket, server) = serve(move |stream| {
            let exchange = Exchange::begin(&stream);
            exchange.read_request().unwrap();
            exchange.reply_fd(region.as_fd(), 0).unwrap();
            heard.recv_timeout(Duration::from_secs(1)).is_ok()
        });
        get_fd(&socket, SECRET).unwrap();
        let _ = returned.send(());
        assert!(!server.join().unwrap(), "get_fd returned before the close");
    }

    #[test]
    fn malformed_requests_are_refused() {
        let long = format!("GET {}", "a".repeat(MAX_LINE));
        let cases: Vec<(&[u8], String)> = vec![
            (
                b"PUT\n",
                format!(
                    "PUT carries no files: send 1 to {MAX_FDS} fds in one SCM_RIGHTS message with the line"
                ),
            ),
            (
                b"GET 0123\n",
                "GET: the secret must be 32 lowercase hex characters".into(),
            ),
            (
                b"GET 0123456789ABCDEF0123456789ABCDEF\n",
                "GET: the secret must be 32 lowercase hex characters".into(),
            ),
            (
                b"GET  0123456789abcdef0123456789abcdef\n",
                "GET: the secret must be 32 lowercase hex characters".into(),
            ),
            (
                b"HELLO\n",
                "unknown request: expected \"PUT\" or \"GET <secret>\"".into(),
            ),
            (
                b"put\n",
                "unknown request: expected \"PUT\" or \"GET <secret>\"".into(),
            ),
            (
                b"PUT\nPUT\n",
                "bytes after the line: one request per connection".into(),
            ),
            (
                b"PUT",
                "the connection closed before the end of the line".into(),
            ),
            (
                long.as_bytes(),
                format!("the line is longer than {MAX_LINE} bytes"),
            ),
        ];
        let mut failures = Vec::new();
        for (bytes, want) in &cases {
            let (mut client, server) = UnixStream::pair().unwrap();
            client.write_all(bytes).unwrap();
            client.shutdown(std::net::Shutdown::Write).unwrap();
            let got = message(Exchange::begin(&server).read_request());
            if got != *want {
                failures.push(format!(
                    "{:?}: want {want:?}, got {got:?}",
                    String::from_utf8_lossy(bytes)
                ));
            }
        }
        let (client, server) = UnixStream::pair().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let line = format!("GET {SECRET}\n");
        send_line(&client, line.as_bytes(), &[client.as_fd()], deadline).unwrap();
        let got = message(Exchange::begin(&server).read_request());
        if got != "GET carries no files" {
            failures.push(format!("GET with an fd: got {got:?}"));
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn files_that_do_not_all_arrive_are_an_error() {
        let file = File::open("/dev/null").unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let mut failures = Vec::new();
        // More fds than expected, and more than the receiver has room for (MSG_CTRUNC).
        for (count, want) in [
            (3, "3 files arrived, at most 1 expected"),
            (
                16,
                "the files did not all arrive (MSG_CTRUNC): at most 1 in one SCM_RIGHTS",
            ),
        ] {
            let (client, server) = UnixStream::pair().unwrap();
            send_line(&client, b"OK 1\n", &vec![file.as_fd(); count], deadline).unwrap();
            let got = read_line(&server, deadline, 1).map(|(line, fds)| (line, fds.len()));
            match got {
                Err(e) if e.to_string().starts_with(want) => {}
                other => failures.push(format!("{count} fds: want {want:?}, got {other:?}")),
            }
        }
        // Fds in two messages of one line.
        let (client, server) = UnixStream::pair().unwrap();
        send_line(&client, b"P", &[file.as_fd()], deadline).unwrap();
        send_line(&client, b"UT\n", &[file.as_fd()], deadline).unwrap();
        match Exchange::begin(&server).read_request() {
            Err(e) if e.to_string() == "the files must come in one SCM_RIGHTS message" => {}
            other => failures.push(format!("two messages: got {other:?}")),
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (_client, server) = UnixStream::pair().unwrap();
        let started = Instant::now();
        let err = read_line(&server, started + Duration::from_millis(100), 1).unwrap_err();
        assert!(
            matches!(&err, HandoffError::Io(e) if e.kind() == io::ErrorKind::TimedOut),
            "{err:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    /// An exchange's 5 s run from the accept it is given, not from when it is read: a
    /// connection that waited for its turn that long gets no request read, even one waiting.
    #[test]
    fn an_exchange_runs_from_its_accept() {
        let (client, server) = UnixStream::pair().unwrap();
        let deadline = Instant::now() + TIMEOUT;
        send_line(&client, format!("GET {SECRET}\n").as_bytes(), &[], deadline).unwrap();
        let accepted = Instant::now() - TIMEOUT;
        match Exchange::since(&server, accepted).read_request() {
            Err(HandoffError::Io(e)) if e.kind() == io::ErrorKind::TimedOut => {}
            other => panic!("expected the exchange's timeout, got {other:?}"),
        }
        assert!(matches!(
            Exchange::since(&server, Instant::now()).read_request(),
            Ok(Request::Get(secret)) if secret == SECRET
        ));
    }

    #[test]
    fn client_reports_refusals_and_bad_replies() {
        let cases: Vec<(&'static str, &str)> = vec![
            (
                "ERR no such secret\n",
                "the daemon refused the handoff: no such secret",
            ),
            (
                "OK twelve\n",
                "the daemon's reply to GET is not \"OK <size>\"",
            ),
            (
                "OK 12\n",
                "the daemon's reply to GET carried 0 files, expected 1",
            ),
            (
                "HELLO\n",
                "the daemon's reply is neither \"OK …\" nor \"ERR …\"",
            ),
        ];
        let mut failures = Vec::new();
        for (reply, want) in cases {
            let (_dir, socket, server) = serve(move |mut stream| {
                let _ = Exchange::begin(&stream).read_request();
                stream.write_all(reply.as_bytes()).unwrap();
            });
            let got = get_fd(&socket, SECRET).map(|(_, size)| size);
            server.join().unwrap();
            match got {
                Err(e) if e.to_string() == want => {}
                other => failures.push(format!("{reply:?}: want {want:?}, got {other:?}")),
            }
        }
        let (_dir, socket, server) = serve(|stream| {
            let exchange = Exchange::begin(&stream);
            let _ = exchange.read_request();
            exchange
                .reply_error("file 0 is a FIFO:\nonly regular files can be passed")
                .unwrap();
        });
        let file = File::open("/dev/null").unwrap();
        match put_fds(&socket, &[file.as_fd()]) {
            Err(HandoffError::Refused(m))
                if m == "file 0 is a FIFO: only regular files can be passed" => {}
            other => failures.push(format!("PUT refused: got {other:?}")),
        }
        server.join().unwrap();
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn client_checks_its_arguments_before_connecting() {
        let nowhere = &ResolvedSocket::explicit("/nonexistent/ws.sock.fd");
        let file = File::open("/dev/null").unwrap();
        let too_many = vec![file.as_fd(); MAX_FDS + 1];
        let cases = [
            (
                put_fds(nowhere, &[]).unwrap_err(),
                "0 files: one handoff passes 1 to 253",
            ),
            (
                put_fds(nowhere, &too_many).unwrap_err(),
                "254 files: one handoff passes 1 to 253",
            ),
            (
                get_fd(nowhere, "0123").unwrap_err(),
                "fd_secret: 32 lowercase hex characters",
            ),
            (
                get_fd(nowhere, SECRET).unwrap_err(),
                "cannot reach the daemon's handoff socket",
            ),
        ];
        let failures: Vec<String> = cases
            .iter()
            .filter(|(e, want)| !e.to_string().starts_with(want))
            .map(|(e, want)| format!("want {want:?}…, got {e}"))
            .collect();
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn a_reply_has_what_is_left_of_the_exchange_s_deadline_not_a_fresh_one() {
        let (mut client, server) = UnixStream::pair().unwrap();
        client
            .write_all(b"GET 0123456789abcdef0123456789abcdef\n")
            .unwrap();
        let exchange = Exchange::begin(&server);
        assert!(matches!(exchange.read_request(), Ok(Request::Get(_))));
        // The request took the exchange's whole time: no reply goes out.
        let spent = Exchange {
            deadline: Instant::now(),
            ..exchange
        };
        let err = spent.reply_fd(server.as_fd(), 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "handoff socket: the exchange did not finish within 5s"
        );
        drop(server);
        let mut sent = Vec::new();
        client.read_to_end(&mut sent).unwrap();
        assert!(sent.is_empty(), "{sent:?}");
    }

    #[test]
    fn reply_error_keeps_to_one_bounded_line() {
        let (mut client, server) = UnixStream::pair().unwrap();
        Exchange::begin(&server)
            .reply_error(&format!("a\nb\r{}", "é".repeat(MAX_LINE)))
            .unwrap();
        drop(server);
        let mut sent = Vec::new();
        client.read_to_end(&mut sent).unwrap();
        let text = String::from_utf8(sent).unwrap();
        assert!(text.len() <= MAX_LINE, "{} bytes", text.len());
        assert!(text.starts_with("ERR a b é"), "{text:.20}");
        assert_eq!(text.matches('\n').count(), 1);
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn put_of_writable_file_is_refused_on_the_wire() {
        // The same refusal end to end: the client sees the daemon's message.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w");
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)
            .unwrap();
        let (_dir, socket, server) = serve(|stream| {
            let exchange = Exchange::begin(&stream);
            if let Err(e) = exchange.read_request() {
                exchange.reply_error(&e.to_string()).unwrap();
            }
        });
        let err = put_fds(&socket, &[file.as_fd()]).unwrap_err();
        server.join().unwrap();
        assert_eq!(
            err.to_string(),
            "the daemon refused the handoff: file 0 is open write-only: open it for reading"
        );
    }
}
