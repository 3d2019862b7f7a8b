//! Copy pacing: a token bucket over a clock, for the copy bandwidth limits (a device's, which
//! emulates a slower link, and a session's share of it).
//!
//! The bucket is pure: it is told the time, it never reads it, and it says how long to wait
//! instead of waiting. The copy thread reads time and sleeps through a [`Clock`], so tests run
//! the scheduler on a [`FakeClock`] whose sleeps only move its time forward: no test depends on
//! how fast the machine is.
//!
//! Credit is kept in nano-bytes (bytes × 10⁹) so that `rate × elapsed ns` is exact in integers:
//! a bucket's long-run rate is its rate, not its rate rounded each time it refills (waits are
//! rounded up to a whole ns, and what that oversleeps is credited back as long as the burst
//! holds more than a ns of the rate, which any real burst does).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::CopyRate;

/// Monotonic time for the copy thread: `now` since the clock's own origin, and `sleep`.
pub trait Clock: Send + Sync {
    fn now(&self) -> Duration;
    fn sleep(&self, d: Duration);
    /// How long in real time to block (on a condition variable, so that others can wake the
    /// caller sooner) for `d` of this clock's time to pass; zero when the clock has moved by
    /// `d` itself.
    fn block_for(&self, d: Duration) -> Duration;
}

/// The machine's monotonic clock.
pub struct SystemClock(Instant);

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock(Instant::now())
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }

    fn block_for(&self, d: Duration) -> Duration {
        d
    }
}

/// A clock that moves only when slept on (or advanced): time is the sum of the sleeps.
#[derive(Default)]
pub struct FakeClock(Mutex<Duration>);

impl FakeClock {
    pub fn advance(&self, d: Duration) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) += d;
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sleep(&self, d: Duration) {
        self.advance(d);
    }

    fn block_for(&self, d: Duration) -> Duration {
        self.advance(d);
        Duration::ZERO
    }
}

const NANO: i128 = 1_000_000_000;

/// Bytes per second with a burst: credit grows at `rate` up to `burst` bytes, a charge takes
/// bytes off and may leave it negative (a debt). Bytes charged by time t never exceed
/// `burst + rate × t`, plus one charge when charges are taken while in credit and then waited
/// out (see [`TokenBucket::delay`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    rate: CopyRate,
    /// In nano-bytes.
    burst: i128,
    /// In nano-bytes, as of `at`; negative while in debt.
    credit: i128,
    at: Duration,
    /// Since when the bucket's owner has had a charge ready that waits for something else (a
    /// link another owner holds), not for this bucket: see [`TokenBucket::waiting_from`].
    waiting: Option<Duration>,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(rate: CopyRate, burst: u64, now: Duration) -> TokenBucket {
        let burst = i128::from(burst) * NANO;
        TokenBucket {
            rate,
            burst,
            credit: burst,
            at: now,
            waiting: None,
        }
    }

    pub fn rate(&self) -> CopyRate {
        self.rate
    }

    /// Credit at `now` (a time before the last one counts as the last one).
    fn credit_at(&self, now: Duration) -> i128 {
        let elapsed = now.saturating_sub(self.at).as_nanos() as i128;
        let refill = elapsed.saturating_mul(i128::from(self.rate.get()));
        self.credit.saturating_add(refill).min(self.burst)
    }

    /// How long from `now` until the bucket is out of debt (zero when it is not in debt).
    pub fn delay(&self, now: Duration) -> Duration {
        let credit = self.credit_at(now);
        if credit >= 0 {
            return Duration::ZERO;
        }
        let rate = i128::from(self.rate.get());
        let ns = (-credit + rate - 1) / rate;
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// Takes `bytes` off the credit at `now`, into debt if need be. If the owner has been
    /// waiting (see [`TokenBucket::waiting_from`]), the charge counts from when it could have
    /// gone on this bucket's credit: the refill since then is not cut at the burst.
    pub fn charge(&mut self, now: Duration, bytes: u64) {
        let at = match self.waiting.take() {
            Some(since) => since.max(self.at + self.delay(self.at)).min(now),
            None => now,
        };
        self.credit = self.credit_at(at) - i128::from(bytes) * NANO;
        self.at = self.at.max(at);
    }

    /// The owner has a charge ready from `now` (unless already from earlier) that waits for
    /// something other than this bucket: its credit keeps growing past the burst meanwhile,
    /// for the next charge, since it is not idle but held back by others.
    pub fn waiting_from(&mut self, now: Duration) {
        self.waiting.get_or_insert(now);
    }

    /// The owner no longer has a charge ready: the credit is capped at the burst again.
    pub fn not_waiting(&mut self) {
        self.waiting = None;
    }

    /// Charges `bytes` and says how long to wait before sending them: sending each charge
    /// once its wait is over keeps the bytes sent by any time t within `burst + rate × t`.
    pub fn reserve(&mut self, now: Duration, bytes: u64) -> Duration {
        self.charge(now, bytes);
        self.delay(now)
    }

    /// Whether the credit is back to the full burst (the bucket holds no state worth keeping).
    pub fn is_full(&self, now: Duration) -> bool {
        self.credit_at(now) >= self.burst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn rate(bytes_per_sec: u64) -> CopyRate {
        CopyRate::new(bytes_per_sec).unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_full_bucket_lets_its_burst_through_at_once() {
        let mut b = TokenBucket::new(rate(GB), 1000, ms(0));
        assert_eq!(b.reserve(ms(0), 600), Duration::ZERO);
        assert_eq!(b.reserve(ms(0), 400), Duration::ZERO);
        assert!(!b.is_full(ms(0)));
        // 1 GB/s refills 1000 bytes in 1 µs.
        assert!(b.is_full(Duration::from_micros(1)));
    }

    #[test]
    fn a_debt_is_waited_out_at_the_rate() {
        let mut b = TokenBucket::new(rate(GB), 0, ms(0));
        // 25 MB at 1 GB/s: 25 ms.
        assert_eq!(b.reserve(ms(0), 25_000_000), ms(25));
        assert_eq!(b.delay(ms(10)), ms(15));
        assert_eq!(b.delay(ms(25)), Duration::ZERO);
        assert_eq!(b.delay(ms(40)), Duration::ZERO);
    }

    /// The credit to the byte at the copy limits tests/gpu/link_cap.py checks, with the
    /// scheduler's burst: a full bucket charged its burst and a second of the rate at once
    /// waits exactly that second; then one byte more waits 1 ns (a byte takes under a ns at
    /// these rates, and waits round up), and a ms of the rate in all waits exactly a ms.
    #[test]
    fn the_credit_is_exact_to_the_byte_at_25_and_12_gb_per_s() {
        let burst = 16 << 20;
        let mut failures = Vec::new();
        for r in [25 * GB, 12 * GB] {
            let mut b = TokenBucket::new(rate(r), burst, ms(0));
            let second = ms(1000);
            let waits = [
                b.reserve(ms(0), burst + r),
                b.delay(second),
                b.reserve(second, 1),
                b.reserve(second, r / 1000 - 1),
                b.delay(second + ms(1)),
            ];
            let want = [
                second,
                Duration::ZERO,
                Duration::from_nanos(1),
                ms(1),
                Duration::ZERO,
            ];
            if waits != want {
                failures.push(format!("{r} B/s: {waits:?}, want {want:?}"));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    #[test]
    fn credit_never_grows_past_the_burst() {
        let mut b = TokenBucket::new(rate(GB), 1_000_000, ms(0));
        // An hour idle still lends only the burst: 3 MB then cost 2 ms.
        assert_eq!(b.reserve(Duration::from_secs(3600), 3_000_000), ms(2));
    }

    /// The copy thread's loop: reserve, sleep the wait (on a fake clock), send. Over many
    /// chunks the clock's time is exactly (bytes - burst) / rate, with no drift from rounding.
    #[test]
    fn paced_chunks_take_exactly_their_bytes_over_the_rate() {
        let cases = [
            // (rate, burst, chunk, chunks)
            (25 * GB, 16 << 20, 8 << 20, 3000),
            (25 * GB, 8 << 20, 8 << 20, 1000),
            (3 * GB, 1_000_000, 1_234_567, 777),
            (100_000_000, 16 << 20, 8 << 20, 30),
        ];
        let mut failures = Vec::new();
        for (r, burst, chunk, n) in cases {
            let clock = FakeClock::default();
            let mut b = TokenBucket::new(rate(r), burst, clock.now());
            for _ in 0..n {
                clock.sleep(b.reserve(clock.now(), chunk));
            }
            let bytes = chunk * n;
            let want = Duration::from_nanos(
                ((bytes - burst) as u128 * 1_000_000_000).div_ceil(r as u128) as u64,
            );
            let got = clock.now();
            // Each wait rounds up to a whole ns; the credit keeps what that oversleeps (the
            // burst is far more than a ns of the rate), so the total is off by at most 1 ns.
            if got.abs_diff(want) > Duration::from_nanos(1) {
                failures.push(format!(
                    "{r} B/s, burst {burst}, {n} × {chunk}: {got:?}, want {want:?}"
                ));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }

    /// Late wake-ups (a sleep that oversleeps, a slow enqueue) are made up by the next waits,
    /// as long as the lateness is within the burst: the long-run rate is the limit.
    #[test]
    fn oversleeping_is_made_up_within_the_burst() {
        let clock = FakeClock::default();
        let chunk = 8 << 20;
        let mut b = TokenBucket::new(rate(25 * GB), 2 * chunk, clock.now());
        for _ in 0..1000 {
            let wait = b.reserve(clock.now(), chunk);
            clock.sleep(wait + Duration::from_micros(60)); // timer slack and the enqueue
        }
        let achieved = (1000 * chunk) as f64 / clock.now().as_secs_f64();
        // Within 0.5 %: the first burst (16 MiB of 8 GiB) goes ahead of the rate.
        assert!(
            (achieved / (25 * GB) as f64 - 1.0).abs() < 0.005,
            "{achieved}"
        );
    }

    /// Credit earned while the owner waits for something else is kept past the burst for
    /// its next charge; once it stops waiting, the burst caps it again.
    #[test]
    fn credit_earned_while_waiting_on_others_is_kept() {
        let us = Duration::from_micros;
        let mut b = TokenBucket::new(rate(GB), 1000, ms(0));
        b.charge(ms(0), 1000);
        b.waiting_from(ms(0));
        // 10 µs at 1 GB/s: 10 000 bytes, ten bursts.
        assert_eq!(b.reserve(us(10), 10_000), Duration::ZERO);
        b.waiting_from(us(10));
        b.not_waiting();
        assert_eq!(b.reserve(us(30), 10_000), us(9));
    }

    #[test]
    fn a_clock_that_goes_back_counts_as_standing_still() {
        let mut b = TokenBucket::new(rate(GB), 0, ms(10));
        b.charge(ms(10), 1_000_000);
        assert_eq!(b.delay(ms(5)), ms(1));
        b.charge(ms(5), 1_000_000);
        assert_eq!(b.delay(ms(10)), ms(2));
    }
}
