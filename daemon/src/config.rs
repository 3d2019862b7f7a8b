//! Daemon configuration, parsed once. [`ConfigFile`] is the settings as written: the TOML file,
//! then command-line flags and environment variables over it. [`ConfigFile::validate`] checks
//! every value and turns the text into types: a [`Config`] holds a `SocketAddr`, a `Duration`,
//! byte counts and a resolved gid, and is the only thing the daemon starts from.

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use bytesize::ByteSize;
use serde::{Deserialize, Deserializer};

use weightstream_proto::socket::SocketCandidates;

/// Loopback by default: the numbers name models and trainers' labels, which are not for the
/// network unless the operator says so.
pub const DEFAULT_METRICS_LISTEN: &str = "127.0.0.1:9464";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, else host.
    Auto,
    /// Shared memory and memcpy: no GPU needed.
    Host,
    /// NVIDIA GPUs through the CUDA driver.
    Cuda,
}

/// A size with units ("64MiB") or a plain number, as bytes.
fn bytes<'de, D: Deserializer<'de>>(de: D) -> Result<u64, D::Error> {
    ByteSize::deserialize(de).map(|b| b.as_u64())
}

/// The lowest copy bandwidth limit, the device's or a session's (100 MB/s): below it a limit
/// is more likely a unit mistake ("25MB/s" for "25GB/s") than a wish, and copies of a
/// 24 GiB model would take minutes.
pub const MIN_COPY_BANDWIDTH: u64 = 100_000_000;

/// Bounds of `limits.max_state_region_bytes`: a page at least (a region is whole pages), and at
/// most 1 EiB, so that a size rounded up to whole pages never overflows.
pub const MIN_STATE_REGION_BYTES: u64 = 4096;
pub const MAX_STATE_REGION_BYTES: u64 = 1 << 60;

/// Bytes per second, as written: "25GB/s", "25 GiB/s", "25GB" or a plain number of bytes per
/// second. Not yet checked against [`MIN_COPY_BANDWIDTH`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawSize")]
pub struct Rate(pub u64);

impl FromStr for Rate {
    type Err = String;

    fn from_str(text: &str) -> Result<Rate, String> {
        let t = text.trim();
        let t = t.strip_suffix("/s").unwrap_or(t).trim_end();
        t.parse::<u64>()
            .map(Rate)
            .or_else(|_| t.parse::<ByteSize>().map(|b| Rate(b.as_u64())))
            .map_err(|_| {
                format!("{text:?} is not a rate like \"25GB/s\", \"25GiB/s\" or bytes per second")
            })
    }
}

impl TryFrom<RawSize> for Rate {
    type Error = String;

    fn try_from(raw: RawSize) -> Result<Self, String> {
        match raw {
            RawSize::Number(n) => Ok(Rate(n)),
            RawSize::Text(text) => text.parse(),
        }
    }
}

impl std::fmt::Display for Rate {
    /// In the largest unit that divides it exactly ("25GB/s", "24GiB/s"), else in bytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match exact_units(self.0) {
            Some(text) => write!(f, "{text}/s"),
            None => write!(f, "{}B/s", self.0),
        }
    }
}

/// A copy bandwidth limit in bytes per second, at least [`MIN_COPY_BANDWIDTH`]: the
/// configuration's `copy_bandwidth_limit` and a session's are checked into it once, where they
/// are read, and the scheduler's token buckets pace at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRate(NonZeroU64);

impl CopyRate {
    /// `bytes_per_sec`, if it is at least [`MIN_COPY_BANDWIDTH`].
    pub fn new(bytes_per_sec: u64) -> Option<CopyRate> {
        NonZeroU64::new(bytes_per_sec)
            .filter(|r| r.get() >= MIN_COPY_BANDWIDTH)
            .map(CopyRate)
    }

    /// Bytes per second.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

impl std::fmt::Display for CopyRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Rate(self.get()).fmt(f)
    }
}

/// `n` bytes in the largest unit that divides it exactly ("25GB", "24GiB"); None for 0 and for
/// sizes no unit divides.
fn exact_units(n: u64) -> Option<String> {
    const UNITS: [(u64, &str); 6] = [
        (1 << 30, "GiB"),
        (1_000_000_000, "GB"),
        (1 << 20, "MiB"),
        (1_000_000, "MB"),
        (1 << 10, "KiB"),
        (1000, "kB"),
    ];
    UNITS
        .iter()
        .find(|(unit, _)| n != 0 && n.is_multiple_of(*unit))
        .map(|(unit, name)| format!("{}{name}", n / unit))
}

/// A size as a TOML value of the config file: `"64GiB"`, or a plain number of bytes.
fn size_value(n: u64) -> String {
    exact_units(n).map_or_else(|| n.to_string(), |text| format!("{text:?}"))
}

/// Limits the daemon enforces on every request (see the README's configuration reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    #[serde(deserialize_with = "bytes")]
    pub max_message_bytes: u64,
    pub max_tensors_per_model: u32,
    pub max_groups_per_session: u32,
    pub max_plan_length: u32,
    pub max_live_tickets: u32,
    /// Grants (CopyGrant) one session may have waiting for an answer at once.
    pub max_waiting_grants: u32,
    #[serde(deserialize_with = "bytes")]
    pub max_upload_bytes: u64,
    pub max_sessions: u32,
    pub max_name_bytes: u32,
    /// Uploads in progress, all uids together: each holds a memfd (an fd of the daemon's).
    pub max_uploads: u32,
    /// Seconds a session waits for its client to take an event off a full `Run` stream
    /// before it gives up on the client and ends.
    pub client_send_timeout_secs: u64,
    /// Seconds a `Run` stream may take to send its first message (attach).
    pub attach_timeout_secs: u64,
    /// Connections one uid may hold open at once, on each socket (gRPC, handoff) apart.
    pub max_connections_per_uid: u32,
    /// The largest state region one AllocStateRegion may ask for.
    #[serde(deserialize_with = "bytes")]
    pub max_state_region_bytes: u64,
    /// State regions one session may hold at once: each is a memfd, an fd of the daemon's.
    pub max_state_regions_per_session: u32,
}

impl Limits {
    pub fn client_send_timeout(&self) -> Duration {
        Duration::from_secs(self.client_send_timeout_secs)
    }

    pub fn attach_timeout(&self) -> Duration {
        Duration::from_secs(self.attach_timeout_secs)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message_bytes: 16 << 20,
            // A manifest of this many tensors with names of ~60 bytes fits in the default
            // message; one header this long parses in well under a second.
            max_tensors_per_model: 100_000,
            max_groups_per_session: 65_536,
            max_plan_length: 1_048_576,
            max_live_tickets: 4096,
            max_waiting_grants: 256,
            max_upload_bytes: 1 << 40,
            max_sessions: 256,
            max_name_bytes: 1024,
            max_uploads: 1024,
            client_send_timeout_secs: 10,
            attach_timeout_secs: 10,
            max_connections_per_uid: 64,
            max_state_region_bytes: 1 << 40,
            max_state_regions_per_session: 64,
        }
    }
}

/// The Prometheus endpoint (`[metrics]`): off unless enabled.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    pub enabled: bool,
    /// `address:port`; kept as text so that a bad value is refused with the key named.
    pub listen: String,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            enabled: false,
            listen: DEFAULT_METRICS_LISTEN.to_string(),
        }
    }
}

/// Who may use the daemon beyond the socket's own mode and group (`[access]`). Both lists empty
/// (the default): every peer that can open the socket. Otherwise a peer is let in when its uid
/// is in `allowed_uids`, or its primary gid (SO_PEERCRED) or one of its supplementary groups
/// (SO_PEERGROUPS), as they were when it connected, is in `allowed_gids`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessConfig {
    pub allowed_uids: Vec<u32>,
    pub allowed_gids: Vec<u32>,
}

impl AccessConfig {
    /// Whether the lists restrict anyone at all.
    pub fn restricts(&self) -> bool {
        !self.allowed_uids.is_empty() || !self.allowed_gids.is_empty()
    }
}

/// A size, or a share of a total that is known only at start (the machine's memory, a device's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawSize")]
pub enum SizeOrShare {
    Bytes(u64),
    Percent(u64),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawSize {
    Number(u64),
    Text(String),
}

impl TryFrom<RawSize> for SizeOrShare {
    type Error = String;

    fn try_from(raw: RawSize) -> Result<Self, String> {
        match raw {
            RawSize::Number(n) => Ok(SizeOrShare::Bytes(n)),
            RawSize::Text(text) => match text.trim().strip_suffix('%') {
                Some(p) => p
                    .trim()
                    .parse::<u64>()
                    .map(SizeOrShare::Percent)
                    .map_err(|_| format!("{text:?} is not a whole percentage like \"80%\"")),
                None => text
                    .parse::<ByteSize>()
                    .map(|b| SizeOrShare::Bytes(b.as_u64()))
                    .map_err(|_| {
                        format!("{text:?} is neither a size (\"64GiB\") nor a percentage (\"80%\")")
                    }),
            },
        }
    }
}

impl SizeOrShare {
    /// Bytes, given the total a percentage refers to.
    pub fn resolve(self, total: u64) -> u64 {
        match self {
            SizeOrShare::Bytes(b) => b,
            SizeOrShare::Percent(p) => (u128::from(total) * u128::from(p) / 100) as u64,
        }
    }
}

impl std::fmt::Display for SizeOrShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeOrShare::Bytes(b) => write!(f, "{b}"),
            SizeOrShare::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// What one uid, and the daemon as a whole, may hold (`[quotas]`). A per-uid limit of 0 means
/// none; the totals keep the daemon from pushing the box into OOM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quotas {
    /// Host copies of models (charged to the uid that loaded or uploaded them first, then to
    /// the next uid holding a reference, a session's included) plus uploads in progress, each
    /// with its description (per tensor: name bytes + 8 × rank + 64; the model's name).
    #[serde(deserialize_with = "bytes")]
    pub per_uid_host_bytes: u64,
    /// Staging plus resident bytes of the uid's open sessions, on all devices together.
    #[serde(deserialize_with = "bytes")]
    pub per_uid_device_bytes: u64,
    pub per_uid_sessions: u32,
    pub per_uid_uploads: u32,
    /// All models and uploads together: a size, or a percentage of MemTotal.
    pub max_host_bytes: SizeOrShare,
    /// Staging plus resident bytes of all sessions on one device: a size, or a percentage of
    /// the device's memory.
    pub max_device_bytes: SizeOrShare,
}

impl SizeOrShare {
    /// As a TOML value of the config file: `"80%"`, `"64GiB"`, or a number of bytes.
    pub fn config_value(self) -> String {
        match self {
            SizeOrShare::Bytes(b) => size_value(b),
            SizeOrShare::Percent(p) => format!("\"{p}%\""),
        }
    }
}

impl std::fmt::Display for Quotas {
    /// The `[quotas]` keys as the config file writes them, on one line (for the log):
    /// `per_uid_host_bytes = "1GiB", …, max_host_bytes = "80%"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "per_uid_host_bytes = {}, per_uid_device_bytes = {}, per_uid_sessions = {}, \
             per_uid_uploads = {}, max_host_bytes = {}, max_device_bytes = {}",
            size_value(self.per_uid_host_bytes),
            size_value(self.per_uid_device_bytes),
            self.per_uid_sessions,
            self.per_uid_uploads,
            self.max_host_bytes.config_value(),
            self.max_device_bytes.config_value(),
        )
    }
}

impl Default for Quotas {
    fn default() -> Self {
        Quotas {
            per_uid_host_bytes: 0,
            per_uid_device_bytes: 0,
            per_uid_sessions: 32,
            per_uid_uploads: 16,
            max_host_bytes: SizeOrShare::Percent(80),
            max_device_bytes: SizeOrShare::Percent(100),
        }
    }
}

/// The daemon's settings as the file gives them (flags override fields), not yet checked.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfigFile {
    /// Left out: [`default_socket`].
    pub socket: Option<PathBuf>,
    /// Group that owns the socket (a name or a numeric gid): its members may connect.
    pub socket_group: Option<String>,
    pub backend: BackendChoice,
    /// Copies a session may have queued ahead of its client.
    pub prefetch_depth: u32,
    /// How long shutdown waits, from the stop request, for sessions and connections to end.
    pub drain_timeout_secs: u64,
    /// Host-to-device bytes per second each device's copies may use (a slower link, emulated);
    /// none by default.
    pub copy_bandwidth_limit: Option<Rate>,
    pub limits: Limits,
    pub metrics: MetricsConfig,
    pub access: AccessConfig,
    pub quotas: Quotas,
}

impl Default for ConfigFile {
    fn default() -> Self {
        ConfigFile {
            socket: None,
            socket_group: None,
            backend: BackendChoice::Auto,
            prefetch_depth: 16,
            drain_timeout_secs: 10,
            copy_bandwidth_limit: None,
            limits: Limits::default(),
            metrics: MetricsConfig::default(),
            access: AccessConfig::default(),
            quotas: Quotas::default(),
        }
    }
}

/// The daemon's settings, checked and typed: what `server::start` takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// An absolute path.
    pub socket: PathBuf,
    /// The socket's group, resolved from `socket_group` (a name or a number).
    pub socket_gid: Option<u32>,
    pub backend: BackendChoice,
    pub prefetch_depth: u32,
    /// How long shutdown waits, from the stop request, for sessions to close and connections
    /// to finish before cutting them; the stop gives up on what is left 2 s after that.
    pub drain_timeout: Duration,
    /// Bytes per second each device's copy thread may issue.
    pub copy_bandwidth_limit: Option<CopyRate>,
    /// Where `/metrics` is served; `None` when metrics are off.
    pub metrics_listen: Option<SocketAddr>,
    pub limits: Limits,
    pub access: AccessConfig,
    pub quotas: Quotas,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{key} = {value} is out of range: {limit}")]
    OutOfRange {
        key: &'static str,
        value: String,
        limit: &'static str,
    },
    #[error("{key} = {value:?} is invalid: {why}")]
    Invalid {
        key: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("socket_group {group:?}: {why}")]
    SocketGroup { group: String, why: String },
}

impl ConfigFile {
    pub fn from_file(path: &Path) -> Result<ConfigFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        ConfigFile::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    /// Parses the text; the values are checked by [`ConfigFile::validate`].
    pub fn from_toml(text: &str) -> Result<ConfigFile, ConfigError> {
        toml::from_str(text).map_err(|e| {
            // toml's message alone does not say where; a line number finds the key.
            let line = e
                .span()
                .map(|span| 1 + text[..span.start.min(text.len())].matches('\n').count());
            let message = match line {
                Some(line) => format!("line {line}: {}", e.message()),
                None => e.message().to_string(),
            };
            ConfigError::Parse {
                path: PathBuf::new(),
                message,
            }
        })
    }

    /// Checks every value (the first bad one is named with its key) and resolves the socket's
    /// group.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let range = |key, value: u64, ok: bool, limit| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::OutOfRange {
                    key,
                    value: value.to_string(),
                    limit,
                })
            }
        };
        let socket = self.socket.unwrap_or_else(default_socket);
        if !socket.is_absolute() {
            return Err(ConfigError::Invalid {
                key: "socket",
                value: socket.display().to_string(),
                why: "must be an absolute path",
            });
        }
        if let Some(group) = &self.socket_group
            && group.trim().is_empty()
        {
            return Err(ConfigError::Invalid {
                key: "socket_group",
                value: group.clone(),
                why: "must name a group or be left out",
            });
        }
        let listen =
            self.metrics
                .listen
                .parse::<SocketAddr>()
                .map_err(|_| ConfigError::Invalid {
                    key: "metrics.listen",
                    value: self.metrics.listen.clone(),
                    why: "must be address:port, e.g. 127.0.0.1:9464",
                })?;
        range(
            "drain_timeout_secs",
            self.drain_timeout_secs,
            self.drain_timeout_secs <= 3600,
            "0 to 3600",
        )?;
        let copy_bandwidth_limit = match self.copy_bandwidth_limit {
            None => None,
            Some(rate) => match CopyRate::new(rate.0) {
                Some(r) => Some(r),
                None => {
                    return Err(ConfigError::OutOfRange {
                        key: "copy_bandwidth_limit",
                        value: rate.to_string(),
                        limit: "at least 100MB/s (leave it out for no limit)",
                    });
                }
            },
        };
        let l = &self.limits;
        let msg = l.max_message_bytes;
        range(
            "limits.max_message_bytes",
            msg,
            (4096..=1 << 30).contains(&msg),
            "4 KiB to 1 GiB",
        )?;
        range(
            "prefetch_depth",
            self.prefetch_depth.into(),
            (1..=1024).contains(&self.prefetch_depth),
            "1 to 1024",
        )?;
        range(
            "limits.max_live_tickets",
            l.max_live_tickets.into(),
            (1..=1 << 20).contains(&l.max_live_tickets),
            "1 to 1048576",
        )?;
        range(
            "limits.max_waiting_grants",
            l.max_waiting_grants.into(),
            (1..=1 << 20).contains(&l.max_waiting_grants),
            "1 to 1048576",
        )?;
        range(
            "limits.max_sessions",
            l.max_sessions.into(),
            l.max_sessions >= 1,
            "at least 1",
        )?;
        range(
            "limits.max_groups_per_session",
            l.max_groups_per_session.into(),
            l.max_groups_per_session >= 1,
            "at least 1",
        )?;
        range(
            "limits.max_name_bytes",
            l.max_name_bytes.into(),
            (16..=65536).contains(&l.max_name_bytes),
            "16 to 65536",
        )?;
        range(
            "limits.max_tensors_per_model",
            l.max_tensors_per_model.into(),
            l.max_tensors_per_model >= 1,
            "at least 1",
        )?;
        range(
            "limits.max_plan_length",
            l.max_plan_length.into(),
            l.max_plan_length >= 1,
            "at least 1",
        )?;
        range(
            "limits.max_uploads",
            l.max_uploads.into(),
            l.max_uploads >= 1,
            "at least 1",
        )?;
        range(
            "limits.max_upload_bytes",
            l.max_upload_bytes,
            l.max_upload_bytes >= 1,
            "at least 1 byte",
        )?;
        for (key, secs) in [
            (
                "limits.client_send_timeout_secs",
                l.client_send_timeout_secs,
            ),
            ("limits.attach_timeout_secs", l.attach_timeout_secs),
        ] {
            range(key, secs, (1..=3600).contains(&secs), "1 to 3600")?;
        }
        range(
            "limits.max_connections_per_uid",
            l.max_connections_per_uid.into(),
            l.max_connections_per_uid >= 1,
            "at least 1",
        )?;
        range(
            "limits.max_state_region_bytes",
            l.max_state_region_bytes,
            (MIN_STATE_REGION_BYTES..=MAX_STATE_REGION_BYTES).contains(&l.max_state_region_bytes),
            "4096 bytes (a page) to 1 EiB",
        )?;
        range(
            "limits.max_state_regions_per_session",
            l.max_state_regions_per_session.into(),
            (1..=1024).contains(&l.max_state_regions_per_session),
            "1 to 1024",
        )?;
        for (key, total) in [
            ("quotas.max_host_bytes", self.quotas.max_host_bytes),
            ("quotas.max_device_bytes", self.quotas.max_device_bytes),
        ] {
            let ok = match total {
                SizeOrShare::Bytes(b) => b >= 1,
                SizeOrShare::Percent(p) => (1..=100).contains(&p),
            };
            if !ok {
                return Err(ConfigError::OutOfRange {
                    key,
                    value: total.to_string(),
                    limit: "1% to 100%, or a size of at least 1 byte",
                });
            }
        }
        let socket_gid = self
            .socket_group
            .as_deref()
            .map(resolve_group)
            .transpose()?;
        Ok(Config {
            socket,
            socket_gid,
            backend: self.backend,
            prefetch_depth: self.prefetch_depth,
            drain_timeout: Duration::from_secs(self.drain_timeout_secs),
            copy_bandwidth_limit,
            metrics_listen: self.metrics.enabled.then_some(listen),
            limits: self.limits,
            access: self.access,
            quotas: self.quotas,
        })
    }
}

/// The socket of a daemon whose configuration names none: `$WEIGHTSTREAM_SOCKET`; else, run as
/// root, the system socket (the service's); else the user's own (`$XDG_RUNTIME_DIR/
/// weightstream.sock`, or `/tmp/weightstream-<uid>/weightstream.sock`). The clients look in
/// the same places (`weightstream_proto::socket`).
pub fn default_socket() -> PathBuf {
    SocketCandidates::from_env(None).for_daemon(rustix::process::geteuid().is_root())
}

/// The gid of `group`: a numeric gid, or a name looked up in /etc/group (the daemon forbids
/// unsafe code, so no getgrnam; groups from NSS-only sources can be given by number).
fn resolve_group(group: &str) -> Result<u32, ConfigError> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let err = |why: String| ConfigError::SocketGroup {
        group: group.to_string(),
        why,
    };
    let text =
        std::fs::read_to_string("/etc/group").map_err(|e| err(format!("/etc/group: {e}")))?;
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(':');
            let name = fields.next()?;
            let gid = fields.nth(1)?.parse::<u32>().ok()?;
            (name == group).then_some(gid)
        })
        .next()
        .ok_or_else(|| err("no such group in /etc/group (give a numeric gid instead)".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses and validates, as `weightstream serve` does.
    fn config(text: &str) -> Result<Config, ConfigError> {
        ConfigFile::from_toml(text)?.validate()
    }

    #[test]
    fn parses_sizes_and_refuses_unknown_keys_and_bad_values() {
        let c = config(
            "socket = \"/tmp/x.sock\"\nbackend = \"host\"\n[limits]\nmax_message_bytes = \"64MiB\"\n",
        )
        .unwrap();
        assert_eq!(c.limits.max_message_bytes, 64 << 20);
        assert_eq!(c.backend, BackendChoice::Host);
        assert_eq!(c.prefetch_depth, 16);
        assert_eq!(c.metrics_listen, None);
        assert_eq!(c.drain_timeout, Duration::from_secs(10));
        assert_eq!(c.socket_gid, None);
        assert_eq!(c.copy_bandwidth_limit, None);
        let q = config(
            "[access]\nallowed_uids = [1000, 1001]\n[quotas]\nper_uid_sessions = 2\n\
             per_uid_host_bytes = \"1GiB\"\nmax_host_bytes = \"64GiB\"\nmax_device_bytes = \"90%\"\n",
        )
        .unwrap();
        assert_eq!(q.access.allowed_uids, vec![1000, 1001]);
        assert!(q.access.restricts());
        assert!(!ConfigFile::default().access.restricts());
        assert_eq!(q.quotas.per_uid_sessions, 2);
        assert_eq!(q.quotas.per_uid_host_bytes, 1 << 30);
        assert_eq!(q.quotas.max_host_bytes, SizeOrShare::Bytes(64 << 30));
        assert_eq!(q.quotas.max_device_bytes, SizeOrShare::Percent(90));
        assert_eq!(q.quotas.max_device_bytes.resolve(1000), 900);
        assert_eq!(SizeOrShare::Bytes(7).resolve(1000), 7);
    }

    #[test]
    fn the_example_config_parses_to_the_defaults() {
        let text = include_str!("../../deploy/config.example.toml");
        let example = ConfigFile::from_toml(text).unwrap();
        assert_eq!(example, ConfigFile::default());
        assert!(example.validate().is_ok());
        // Every key the daemon knows is in the example (socket and socket_group commented out:
        // the socket's default depends on who runs the daemon, the group's is "none").
        let keys = [
            "# socket =",
            "# socket_group =",
            "backend =",
            "prefetch_depth =",
            "drain_timeout_secs =",
            "# copy_bandwidth_limit =",
            "[metrics]",
            "enabled =",
            "listen =",
            "[limits]",
            "max_message_bytes =",
            "max_tensors_per_model =",
            "max_groups_per_session =",
            "max_plan_length =",
            "max_live_tickets =",
            "max_waiting_grants =",
            "max_upload_bytes =",
            "max_sessions =",
            "max_name_bytes =",
            "max_uploads =",
            "client_send_timeout_secs =",
            "attach_timeout_secs =",
            "max_connections_per_uid =",
            "max_state_region_bytes =",
            "max_state_regions_per_session =",
            "[access]",
            "allowed_uids =",
            "allowed_gids =",
            "[quotas]",
            "per_uid_host_bytes =",
            "per_uid_device_bytes =",
            "per_uid_sessions =",
            "per_uid_uploads =",
            "max_host_bytes =",
            "max_device_bytes =",
        ];
        for key in keys {
            assert!(
                text.lines().any(|l| l.starts_with(key)),
                "{key} missing from the example"
            );
        }
        let on = config("[metrics]\nenabled = true\n").unwrap();
        assert_eq!(on.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
    }

    #[test]
    fn quotas_are_shown_in_the_config_file_s_syntax() {
        assert_eq!(
            Quotas::default().to_string(),
            "per_uid_host_bytes = 0, per_uid_device_bytes = 0, per_uid_sessions = 32, \
             per_uid_uploads = 16, max_host_bytes = \"80%\", max_device_bytes = \"100%\""
        );
        let text = "[quotas]\nper_uid_host_bytes = \"64GiB\"\nper_uid_device_bytes = 123456789\n\
                    per_uid_sessions = 2\nper_uid_uploads = 1\nmax_host_bytes = \"500GB\"\n\
                    max_device_bytes = \"90%\"\n";
        let quotas = config(text).unwrap().quotas;
        let shown = quotas.to_string();
        assert_eq!(
            shown,
            "per_uid_host_bytes = \"64GiB\", per_uid_device_bytes = 123456789, \
             per_uid_sessions = 2, per_uid_uploads = 1, max_host_bytes = \"500GB\", \
             max_device_bytes = \"90%\""
        );
        // What the log shows reads back as the same quotas.
        let again = config(&format!("[quotas]\n{}\n", shown.replace(", ", "\n")));
        assert_eq!(again.unwrap().quotas, quotas);
    }

    #[test]
    fn copy_bandwidth_limits_are_read_in_any_unit() {
        let cases: &[(&str, u64)] = &[
            ("\"25GB/s\"", 25_000_000_000),
            ("\"25 GB/s\"", 25_000_000_000),
            ("\"25GiB/s\"", 25 << 30),
            ("\"25GB\"", 25_000_000_000),
            ("\"1.5GB/s\"", 1_500_000_000),
            ("\"100MB/s\"", 100_000_000),
            ("25000000000", 25_000_000_000),
            ("\"25000000000\"", 25_000_000_000),
        ];
        let mut failures = Vec::new();
        for (value, want) in cases {
            let got = config(&format!("copy_bandwidth_limit = {value}"))
                .map(|c| c.copy_bandwidth_limit.map(CopyRate::get));
            if !matches!(got, Ok(Some(g)) if g == *want) {
                failures.push(format!("{value}: {got:?}, want {want}"));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
        let shown: Vec<String> = [25_000_000_000, 25 << 30, 100_000_000, 123_456_789]
            .map(|n| Rate(n).to_string())
            .into();
        assert_eq!(shown, ["25GB/s", "25GiB/s", "100MB/s", "123456789B/s"]);
    }

    #[test]
    fn socket_group_is_resolved_to_a_gid_when_validated() {
        let gid = |text| config(text).map(|c| c.socket_gid);
        assert_eq!(gid("socket_group = \"4242\"").unwrap(), Some(4242));
        assert_eq!(gid("socket_group = \"root\"").unwrap(), Some(0));
        assert_eq!(
            gid("socket_group = \"no-such-group-ws\"")
                .unwrap_err()
                .to_string(),
            "socket_group \"no-such-group-ws\": no such group in /etc/group (give a numeric gid \
             instead)"
        );
    }

    #[test]
    fn each_bad_config_is_refused_with_its_own_message() {
        let cases: &[(&str, &str)] = &[
            (
                "sockets = \"/x\"",
                "line 1: unknown field `sockets`, expected one of `socket`, `socket_group`, \
                 `backend`, `prefetch_depth`, `drain_timeout_secs`, `copy_bandwidth_limit`, \
                 `limits`, `metrics`, `access`, `quotas`",
            ),
            (
                "[limits]\nmax_sesions = 3",
                "line 2: unknown field `max_sesions`, expected one of `max_message_bytes`, \
                 `max_tensors_per_model`, `max_groups_per_session`, `max_plan_length`, \
                 `max_live_tickets`, `max_waiting_grants`, `max_upload_bytes`, `max_sessions`, \
                 `max_name_bytes`, `max_uploads`, `client_send_timeout_secs`, \
                 `attach_timeout_secs`, `max_connections_per_uid`, `max_state_region_bytes`, \
                 `max_state_regions_per_session`",
            ),
            (
                "[metrics]\nport = 9464",
                "line 2: unknown field `port`, expected `enabled` or `listen`",
            ),
            (
                "backend = \"gpu\"",
                "line 1: unknown variant `gpu`, expected one of `auto`, `host`, `cuda`",
            ),
            (
                "prefetch_depth = \"many\"",
                "line 1: invalid type: string \"many\", expected u32",
            ),
            (
                "prefetch_depth = 0",
                "prefetch_depth = 0 is out of range: 1 to 1024",
            ),
            (
                "prefetch_depth = 1025",
                "prefetch_depth = 1025 is out of range: 1 to 1024",
            ),
            (
                "drain_timeout_secs = 86400",
                "drain_timeout_secs = 86400 is out of range: 0 to 3600",
            ),
            (
                "[limits]\nmax_message_bytes = \"1KiB\"",
                "limits.max_message_bytes = 1024 is out of range: 4 KiB to 1 GiB",
            ),
            (
                "[limits]\nmax_live_tickets = 0",
                "limits.max_live_tickets = 0 is out of range: 1 to 1048576",
            ),
            (
                "[limits]\nmax_sessions = 0",
                "limits.max_sessions = 0 is out of range: at least 1",
            ),
            (
                "[limits]\nmax_name_bytes = 8",
                "limits.max_name_bytes = 8 is out of range: 16 to 65536",
            ),
            (
                "[limits]\nmax_plan_length = 0",
                "limits.max_plan_length = 0 is out of range: at least 1",
            ),
            (
                "[limits]\nmax_uploads = 0",
                "limits.max_uploads = 0 is out of range: at least 1",
            ),
            (
                "[limits]\nclient_send_timeout_secs = 0",
                "limits.client_send_timeout_secs = 0 is out of range: 1 to 3600",
            ),
            (
                "[limits]\nattach_timeout_secs = 3601",
                "limits.attach_timeout_secs = 3601 is out of range: 1 to 3600",
            ),
            (
                "[limits]\nmax_connections_per_uid = 0",
                "limits.max_connections_per_uid = 0 is out of range: at least 1",
            ),
            (
                "[limits]\nmax_state_region_bytes = 4095",
                "limits.max_state_region_bytes = 4095 is out of range: 4096 bytes (a page) to \
                 1 EiB",
            ),
            (
                "[limits]\nmax_state_regions_per_session = 1025",
                "limits.max_state_regions_per_session = 1025 is out of range: 1 to 1024",
            ),
            (
                "shm_dir = \"/dev/shm\"",
                "line 1: unknown field `shm_dir`, expected one of `socket`, `socket_group`, \
                 `backend`, `prefetch_depth`, `drain_timeout_secs`, `copy_bandwidth_limit`, \
                 `limits`, `metrics`, `access`, `quotas`",
            ),
            (
                "socket = \"ws.sock\"",
                "socket = \"ws.sock\" is invalid: must be an absolute path",
            ),
            (
                "socket_group = \" \"",
                "socket_group = \" \" is invalid: must name a group or be left out",
            ),
            (
                "[quotas]\nmax_host_bytes = \"0%\"",
                "quotas.max_host_bytes = 0% is out of range: 1% to 100%, or a size of at least \
                 1 byte",
            ),
            (
                "[quotas]\nmax_device_bytes = \"101%\"",
                "quotas.max_device_bytes = 101% is out of range: 1% to 100%, or a size of at \
                 least 1 byte",
            ),
            (
                "[quotas]\nmax_host_bytes = 0",
                "quotas.max_host_bytes = 0 is out of range: 1% to 100%, or a size of at least \
                 1 byte",
            ),
            (
                "[quotas]\nmax_host_bytes = \"lots\"",
                "line 2: \"lots\" is neither a size (\"64GiB\") nor a percentage (\"80%\")",
            ),
            (
                "[quotas]\nper_uid_session = 2",
                "line 2: unknown field `per_uid_session`, expected one of `per_uid_host_bytes`, \
                 `per_uid_device_bytes`, `per_uid_sessions`, `per_uid_uploads`, \
                 `max_host_bytes`, `max_device_bytes`",
            ),
            (
                "[access]\nallowed_uids = [-1]",
                "line 2: invalid value: integer `-1`, expected u32",
            ),
            (
                "copy_bandwidth_limit = \"25MB/s\"",
                "copy_bandwidth_limit = 25MB/s is out of range: at least 100MB/s (leave it out \
                 for no limit)",
            ),
            (
                "copy_bandwidth_limit = 0",
                "copy_bandwidth_limit = 0B/s is out of range: at least 100MB/s (leave it out for \
                 no limit)",
            ),
            (
                "copy_bandwidth_limit = \"fast\"",
                "line 1: \"fast\" is not a rate like \"25GB/s\", \"25GiB/s\" or bytes per second",
            ),
            (
                "[metrics]\nlisten = \"localhost\"",
                "metrics.listen = \"localhost\" is invalid: must be address:port, e.g. \
                 127.0.0.1:9464",
            ),
        ];
        for (text, want) in cases {
            let got = config(text).unwrap_err().to_string();
            // Parse errors carry the file's path (none here) before the message.
            let got = got.strip_prefix(": ").unwrap_or(&got);
            assert_eq!(got, *want, "for config {text:?}");
        }
    }
}
