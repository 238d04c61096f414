//! Lock-free completion polling.
//!
//! Each lane (one per direction) numbers its transfers 1, 2, 3, ... in submission order, and its
//! backend publishes the highest number whose copies are done: a worker thread's atomic store on
//! the host backend, a stream writing into mapped pinned memory (`cuStreamWriteValue64`) on CUDA.
//! Copies of one lane complete in order, so "done up to `c`" is all a poll needs to know.
//!
//! The lane keeps its in-flight records in a bounded FIFO (`crossbeam_queue::ArrayQueue`, pushed
//! under the engine's submit lock, in sequence order). A poll reads `c`, claims the range
//! `(reported, c]` with one compare-and-swap on `reported`, and pops exactly that many records.
//! Pollers racing each other claim disjoint ranges, and every pop is of a completed record because
//! all records up to the largest claimed `c` were pushed before their copies were issued. So each
//! record is handed out exactly once, and polling takes no lock and makes no blocking call.

use std::time::Instant;

use crate::slab::Slab;
use crate::sync::{ArrayQueue, AtomicU64, Ordering};
use crate::transfer::JobId;

/// A transfer in flight on a lane.
#[derive(Debug)]
pub struct InFlight {
    pub seq: u64,
    pub job_id: JobId,
    pub bytes: u64,
    pub submitted_at: Instant,
    pub slab: Slab,
}

/// One ordered lane of in-flight transfers.
#[derive(Debug)]
pub struct Lane {
    records: ArrayQueue<InFlight>,
    /// The highest sequence number whose record has been claimed by a poll.
    reported: AtomicU64,
    /// The highest sequence number pushed.
    pushed: AtomicU64,
}

impl Lane {
    /// A lane holding at most `capacity` transfers in flight.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Lane {
            records: ArrayQueue::new(capacity.max(1)),
            reported: AtomicU64::new(0),
            pushed: AtomicU64::new(0),
        }
    }

    /// The sequence number the next pushed record must carry.
    pub fn next_seq(&self) -> u64 {
        self.pushed.load(Ordering::Relaxed) + 1
    }

    /// Adds a record. Callers serialise pushes (the engine's submit lock) and push before issuing
    /// the copies, so a record is always in the queue before its completion can be observed.
    /// Gives the record back when the lane is full.
    pub fn push(&self, record: InFlight) -> Result<(), InFlight> {
        debug_assert_eq!(
            record.seq,
            self.next_seq(),
            "records are pushed in sequence order"
        );
        let seq = record.seq;
        self.records.push(record)?;
        // Release: a poller that reads `pushed` (draining a failed lane) sees the record.
        self.pushed.store(seq, Ordering::Release);
        Ok(())
    }

    /// Records in flight: pushed and not yet handed out by a poll.
    ///
    /// This counts the queue itself, not `pushed - reported`: a record a poll has claimed but not
    /// popped yet still holds its place, so while pushes are serialised a push that follows
    /// `in_flight() < capacity` always finds room. (`pushed - reported`, read without the submit
    /// lock, could also see a claim newer than the push it had read, and underflow.) Both were
    /// found by the loom models in `tests/loom.rs`.
    pub fn in_flight(&self) -> u64 {
        self.records.len() as u64
    }

    /// Hands every record with `seq <= completed` not handed out before to `on_done`.
    /// Lock-free; safe to call from any number of threads at once.
    pub fn poll(&self, completed: u64, mut on_done: impl FnMut(InFlight)) {
        // Acquire on the load and AcqRel on the swap: the records we pop were pushed (Release in
        // the queue) before the backend published `completed`, which the caller read with Acquire.
        let mut reported = self.reported.load(Ordering::Acquire);
        loop {
            if completed <= reported {
                return;
            }
            match self.reported.compare_exchange_weak(
                reported,
                completed,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => reported = now,
            }
        }
        for _ in reported..completed {
            // Exactly (completed - reported) records with seq <= completed are in the queue ahead
            // of any later one: the pops cannot come up short.
            let record = self
                .records
                .pop()
                .expect("a completed record is in the queue");
            on_done(record);
        }
    }

    /// Hands out every record pushed so far, complete or not. For a lane whose backend failed
    /// fatally: nothing on it will complete, and the device no longer runs.
    pub fn drain(&self, on_done: impl FnMut(InFlight)) {
        self.poll(self.pushed.load(Ordering::Acquire), on_done);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::pool::Pool;
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex};

    fn record(pool: &Pool, seq: u64) -> InFlight {
        InFlight {
            seq,
            job_id: seq * 10,
            bytes: 1,
            submitted_at: Instant::now(),
            slab: pool.acquire(1).unwrap(),
        }
    }

    #[test]
    fn hands_out_completed_records_in_order_once() {
        let pool = Pool::new(Arc::new(HostBackend::new()), 1 << 20);
        let lane = Lane::new(8);
        for seq in 1..=5 {
            lane.push(record(&pool, seq)).unwrap();
        }
        let mut got = vec![];
        // Every record handed out goes home to the pool (a slab never released is leaked on
        // purpose, and Miri's leak check would say so).
        let mut take = |r: InFlight| {
            got.push(r.seq);
            pool.release(r.slab);
        };
        lane.poll(0, |r| {
            panic!("record {} handed out before its completion", r.seq)
        });
        lane.poll(3, &mut take);
        lane.poll(3, &mut take);
        lane.poll(2, &mut take);
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(lane.in_flight(), 2);
        let mut take = |r: InFlight| {
            got.push(r.seq);
            pool.release(r.slab);
        };
        lane.drain(&mut take);
        assert_eq!(got, vec![1, 2, 3, 4, 5]);
        assert_eq!(lane.in_flight(), 0);
    }

    #[test]
    fn a_claimed_record_counts_until_it_is_handed_out() {
        // While a poll hands out its claim, the records not popped yet still fill the queue: a
        // push admitted by `in_flight() < capacity` must find room.
        let pool = Pool::new(Arc::new(HostBackend::new()), 1 << 20);
        let lane = Lane::new(2);
        lane.push(record(&pool, 1)).unwrap();
        lane.push(record(&pool, 2)).unwrap();
        let mut pushed = false;
        lane.poll(2, |r| {
            if r.seq == 1 {
                assert_eq!(lane.in_flight(), 1, "record 2 is claimed but still queued");
                lane.push(record(&pool, 3)).unwrap();
                pushed = true;
            }
            pool.release(r.slab);
        });
        assert!(pushed);
        assert_eq!(lane.in_flight(), 1);
        lane.drain(|r| pool.release(r.slab));
        assert_eq!(lane.in_flight(), 0);
    }

    #[test]
    fn refuses_past_capacity() {
        let pool = Pool::new(Arc::new(HostBackend::new()), 1 << 20);
        let lane = Lane::new(2);
        lane.push(record(&pool, 1)).unwrap();
        lane.push(record(&pool, 2)).unwrap();
        let refused = lane.push(record(&pool, 3)).unwrap_err();
        pool.release(refused.slab);
        lane.drain(|r| pool.release(r.slab));
    }

    #[test]
    fn racing_pollers_report_each_record_exactly_once() {
        const N: u64 = if cfg!(miri) { 200 } else { 20_000 };
        let pool = Arc::new(Pool::new(Arc::new(HostBackend::new()), 1 << 24));
        let lane = Arc::new(Lane::new(256));
        let completed = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let pollers: Vec<_> = (0..3)
            .map(|_| {
                let (lane, completed, seen, stop, pool) = (
                    lane.clone(),
                    completed.clone(),
                    seen.clone(),
                    stop.clone(),
                    pool.clone(),
                );
                std::thread::spawn(move || {
                    let mut mine = vec![];
                    while !stop.load(Ordering::Acquire) || lane.in_flight() > 0 {
                        lane.poll(completed.load(Ordering::Acquire), |r| {
                            mine.push(r.seq);
                            pool.release(r.slab);
                        });
                    }
                    seen.lock().unwrap().extend(mine);
                })
            })
            .collect();
        for seq in 1..=N {
            let mut r = record(&pool, seq);
            loop {
                match lane.push(r) {
                    Ok(()) => break,
                    Err(back) => {
                        r = back;
                        std::thread::yield_now();
                    }
                }
            }
            completed.store(seq, Ordering::Release);
        }
        stop.store(true, Ordering::Release);
        for p in pollers {
            p.join().unwrap();
        }
        let mut seen = Arc::try_unwrap(seen).unwrap().into_inner().unwrap();
        seen.sort_unstable();
        assert_eq!(seen, (1..=N).collect::<Vec<_>>());
        assert_eq!(
            pool.stats().free,
            pool.stats().slabs,
            "every slab came home"
        );
    }
}
