//! Daemon configuration: parsed and validated once at start. The TOML file gives the base,
//! command-line flags and environment variables override it.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use bytesize::ByteSize;
use serde::Deserialize;

pub const DEFAULT_SOCKET: &str = "/run/weightstream/weightstream.sock";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, else host.
    Auto,
    /// Shared memory and memcpy: no GPU needed.
    Host,
    /// NVIDIA GPUs through the CUDA driver.
    Cuda,
}

/// Limits the daemon enforces on every request (see the README's configuration reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_message_bytes: ByteSize,
    pub max_tensors_per_model: u32,
    pub max_groups_per_session: u32,
    pub max_plan_length: u32,
    pub max_live_tickets: u32,
    pub max_upload_bytes: ByteSize,
    pub max_sessions: u32,
    pub max_name_bytes: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message_bytes: ByteSize::mib(16),
            max_tensors_per_model: 1_000_000,
            max_groups_per_session: 65_536,
            max_plan_length: 1_048_576,
            max_live_tickets: 4096,
            max_upload_bytes: ByteSize::tib(1),
            max_sessions: 256,
            max_name_bytes: 1024,
        }
    }
}

/// The `[daemon]` settings as the file gives them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub socket: PathBuf,
    pub backend: BackendChoice,
    /// Where shared-memory segments are created.
    pub shm_dir: PathBuf,
    /// Copies a session may have queued ahead of its client.
    pub prefetch_depth: u32,
    /// How long shutdown waits for running copies and connections.
    pub drain_timeout_secs: u64,
    pub limits: Limits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: PathBuf::from(DEFAULT_SOCKET),
            backend: BackendChoice::Auto,
            shm_dir: PathBuf::from("/dev/shm"),
            prefetch_depth: 16,
            drain_timeout_secs: 10,
            limits: Limits::default(),
        }
    }
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
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::new(),
            message: e.message().to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
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
        let l = &self.limits;
        let msg = l.max_message_bytes.as_u64();
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_and_refuses_unknown_keys_and_bad_values() {
        let c = Config::from_toml(
            "socket = \"/tmp/x.sock\"\nbackend = \"host\"\n[limits]\nmax_message_bytes = \"64MiB\"\n",
        )
        .unwrap();
        assert_eq!(c.limits.max_message_bytes, ByteSize::mib(64));
        assert_eq!(c.backend, BackendChoice::Host);
        assert_eq!(c.prefetch_depth, 16);
        let e = Config::from_toml("sockets = \"/x\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `sockets`"), "{e}");
        let e = Config::from_toml("prefetch_depth = 0")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "prefetch_depth = 0 is out of range: 1 to 1024");
        let e = Config::from_toml("[limits]\nmax_message_bytes = \"1KiB\"")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "limits.max_message_bytes = 1024 is out of range: 4 KiB to 1 GiB"
        );
    }
}
