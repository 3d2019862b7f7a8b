//! Where a load's or a commit's time went, phase by phase (wall clock), for the manifest the
//! call returns (`StorePhases`) and the daemon's log: "is it the reading or the page-locking?"
//! has an answer without a profiler.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Model;

/// Each phase's wall-clock time; a phase the call did not go through is zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Phases {
    /// Making the host arena: its pages allocated and zeroed (on several threads).
    pub alloc: Duration,
    /// A load: reading the files into the arena (quantizing too, overlapped, when it does).
    pub read: Duration,
    /// A commit: sealing the upload against writes (and reserving any page it lacks).
    pub seal: Duration,
    /// A commit that quantizes: the new arena, made and filled.
    pub quantize: Duration,
    /// With a coding: the tensors coded into the model's arena ([`super::coding`]).
    pub code: Duration,
    /// A commit: hashing the bytes into the model's id; runs while the arena is pinned.
    pub hash: Duration,
    /// Page-locking the arena (zero on the host backend, which locks nothing).
    pub pin: Duration,
    /// The whole call.
    pub total: Duration,
    /// Bytes read from the files, or written into the upload by its client.
    pub input_bytes: u64,
}

impl Phases {
    /// Runs `f`, adding the time it takes to the phase `slot` picks.
    pub fn time<T>(&mut self, slot: fn(&mut Phases) -> &mut Duration, f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = f();
        *slot(self) += started.elapsed();
        out
    }

    /// Zeroes the page-locking time where nothing was locked (the host backend): what is left
    /// is the call's overhead, not a phase.
    pub fn nothing_pinned_unless(&mut self, pinned: bool) {
        if !pinned {
            self.pin = Duration::ZERO;
        }
    }

    /// Input bytes per second over the whole call.
    pub fn gb_per_s(&self) -> f64 {
        self.input_bytes as f64 / self.total.as_secs_f64().max(1e-9) / 1e9
    }
}

/// What a load or a commit made: the model, whether an identical one was stored already (the
/// call then holds one more reference to it), and where the time went.
#[derive(Debug)]
pub struct Stored {
    pub model: Arc<Model>,
    pub existed: bool,
    pub phases: Phases,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_phase_adds_up() {
        let mut p = Phases::default();
        let x = p.time(
            |p| &mut p.read,
            || {
                std::thread::sleep(Duration::from_millis(2));
                7
            },
        );
        p.time(
            |p| &mut p.read,
            || std::thread::sleep(Duration::from_millis(2)),
        );
        assert_eq!(x, 7);
        assert!(p.read >= Duration::from_millis(4), "{p:?}");
        assert_eq!(p.pin, Duration::ZERO);
    }
}
