//! Per-direction distributions of what a caller waits for: each transfer's wall-clock time (from
//! its submission to the poll that reports it, as `get_finished` sees it) and each submission's
//! host time in the core, as p50 and p99, with the submissions refused before anything was
//! issued and those the backend failed to issue. Lock-free: relaxed atomic counters in
//! log-linear buckets (16 per power of two, so a reported percentile is within 1/32 of the
//! true one), read by `stats` while submits and polls run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::direction::Direction;

/// Buckets per power of two (`2^SUB_BITS`).
const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
/// Values below `SUB` have a bucket each; each power of two from there has `SUB`.
const BUCKETS: usize = (SUB + (64 - SUB_BITS as u64) * SUB) as usize;

/// A histogram of nanoseconds.
#[derive(Debug)]
pub(crate) struct Histogram {
    counts: Box<[AtomicU64]>,
    total: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            total: AtomicU64::new(0),
        }
    }
}

fn bucket_of(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let octave = 63 - u64::from(v.leading_zeros()); // >= SUB_BITS
    let shift = octave - u64::from(SUB_BITS);
    let sub = (v >> shift) - SUB; // 0..SUB
    (SUB + shift * SUB + sub) as usize
}

/// The middle of bucket `i`'s range.
fn value_of(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let shift = (i - SUB) / SUB;
    let sub = (i - SUB) % SUB;
    let lower = (SUB + sub) << shift;
    lower + ((1u64 << shift) >> 1)
}

impl Histogram {
    pub(crate) fn record(&self, nanos: u64) {
        // Relaxed: statistics only; a reader may see a sample in `total` before its bucket (the
        // percentile walk then stops at the last bucket).
        self.counts[bucket_of(nanos)].fetch_add(1, Ordering::Relaxed);
        self.total.fetch_add(1, Ordering::Relaxed);
    }

    /// The `q`-quantile (0 < q <= 1) in nanoseconds, None without a sample.
    pub(crate) fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.total.load(Ordering::Relaxed);
        if total == 0 {
            return None;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )] // a rank within 1..=total
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        let mut last = None;
        for (i, c) in self.counts.iter().enumerate() {
            let c = c.load(Ordering::Relaxed);
            if c > 0 {
                seen += c;
                last = Some(i);
                if seen >= rank {
                    return Some(value_of(i));
                }
            }
        }
        last.map(value_of)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[derive(Debug, Default)]
struct LaneLatency {
    transfer: Histogram,
    submit: Histogram,
    refused: AtomicU64,
    submit_failed: AtomicU64,
}

/// The distributions of an engine's four directions.
#[derive(Debug, Default)]
pub(crate) struct Latency {
    lanes: [LaneLatency; 4],
}

/// One submission being timed: its host time is recorded when it is dropped, and it counts as
/// refused unless [`Submission::issued`] said otherwise.
pub(crate) struct Submission<'a> {
    lane: &'a LaneLatency,
    start: Instant,
    issued: bool,
}

impl Submission<'_> {
    /// The submission reached the backend: `ok` false when the backend failed to issue it.
    pub(crate) fn issued(&mut self, ok: bool) {
        self.issued = true;
        if !ok {
            // Relaxed: statistics only.
            self.lane.submit_failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Submission<'_> {
    fn drop(&mut self) {
        self.lane.submit.record(nanos(self.start.elapsed()));
        if !self.issued {
            // Relaxed: statistics only.
            self.lane.refused.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// p50 and p99 of one direction's transfers and submissions (nanoseconds; None without a
/// sample), and its refused and failed submissions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneLatencyStats {
    pub transfer_p50_ns: Option<u64>,
    pub transfer_p99_ns: Option<u64>,
    pub submit_p50_ns: Option<u64>,
    pub submit_p99_ns: Option<u64>,
    /// Submissions refused before anything was issued (bad input, too many in flight, the pool
    /// exhausted, shut down, a failed lane).
    pub refused: u64,
    /// Submissions the backend failed to issue (the lane then fails its transfers).
    pub submit_failed: u64,
}

impl Latency {
    /// Starts timing a submission of `direction`.
    pub(crate) fn submission(&self, direction: Direction) -> Submission<'_> {
        Submission {
            lane: &self.lanes[direction.lane()],
            start: Instant::now(),
            issued: false,
        }
    }

    /// A transfer of `direction` reported after `wall` since its submission.
    pub(crate) fn transferred(&self, direction: Direction, wall: Duration) {
        self.lanes[direction.lane()].transfer.record(nanos(wall));
    }

    pub(crate) fn stats(&self) -> [LaneLatencyStats; 4] {
        std::array::from_fn(|i| {
            let l = &self.lanes[i];
            LaneLatencyStats {
                transfer_p50_ns: l.transfer.quantile(0.5),
                transfer_p99_ns: l.transfer.quantile(0.99),
                submit_p50_ns: l.submit.quantile(0.5),
                submit_p99_ns: l.submit.quantile(0.99),
                // Relaxed: statistics only.
                refused: l.refused.load(Ordering::Relaxed),
                submit_failed: l.submit_failed.load(Ordering::Relaxed),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order_within_a_32nd() {
        let mut prev = 0;
        for v in (0..5000u64).chain([1 << 20, (1 << 40) + 12_345, u64::MAX / 3, u64::MAX]) {
            let b = bucket_of(v);
            assert!(b < BUCKETS, "{v}");
            assert!(b >= prev || v > 5000, "buckets out of order at {v}");
            prev = b;
            let mid = value_of(b);
            #[allow(clippy::cast_precision_loss)]
            let err = (mid as f64 - v as f64).abs() / (v.max(1) as f64);
            assert!(err <= 1.0 / 32.0 + 1e-12 || v < SUB, "{v}: {mid} ({err})");
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        let h = Histogram::default();
        assert_eq!(h.quantile(0.5), None);
        // 1..=1000 µs: p50 500 µs, p99 990 µs, each within a 32nd.
        for us in 1..=1000u64 {
            h.record(us * 1000);
        }
        let p50 = h.quantile(0.5).unwrap();
        let p99 = h.quantile(0.99).unwrap();
        assert!((484_000..=516_000).contains(&p50), "{p50}");
        assert!((959_000..=1_021_000).contains(&p99), "{p99}");
        let one = Histogram::default();
        one.record(7);
        assert_eq!((one.quantile(0.5), one.quantile(0.99)), (Some(7), Some(7)));
    }

    #[test]
    fn a_submission_is_refused_unless_issued() {
        let l = Latency::default();
        drop(l.submission(Direction::HostToDevice));
        let mut s = l.submission(Direction::HostToDevice);
        s.issued(true);
        drop(s);
        let mut s = l.submission(Direction::DeviceToHost);
        s.issued(false);
        drop(s);
        l.transferred(Direction::HostToDevice, Duration::from_micros(30));
        let st = l.stats();
        let h2d = st[Direction::HostToDevice.lane()];
        assert_eq!((h2d.refused, h2d.submit_failed), (1, 0));
        assert!(h2d.submit_p50_ns.is_some() && h2d.submit_p99_ns >= h2d.submit_p50_ns);
        assert!((29_000..=31_000).contains(&h2d.transfer_p50_ns.unwrap()));
        let d2h = st[Direction::DeviceToHost.lane()];
        assert_eq!(
            (d2h.refused, d2h.submit_failed, d2h.transfer_p50_ns),
            (0, 1, None)
        );
    }
}
