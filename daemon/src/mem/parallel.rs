//! Work spread over threads: the items of one queue taken in order by up to N workers, each
//! result handed back to the calling thread (which reports progress or collects them there: the
//! store's progress callbacks are not `Send`). Segments populate their pages this way, loads
//! read files and commits hash their bytes: one core zeroes, copies or hashes a few GB/s, a
//! model is tens of GB.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, mpsc};

/// Threads for `items` pieces of work: the cores there are, at most `max` and `items`, at
/// least one.
pub fn threads_for(items: usize, max: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(max)
        .min(items)
        .max(1)
}

/// Runs `work` on each item on `threads` threads (items are taken in order) and calls `done`
/// here with each result as it comes. At the first error no further item is started; that
/// error is returned once the items in flight are done.
pub fn for_each<T, R, E>(
    items: Vec<T>,
    threads: usize,
    work: impl Fn(T) -> Result<R, E> + Sync,
    mut done: impl FnMut(R),
) -> Result<(), E>
where
    T: Send,
    R: Send,
    E: Send,
{
    let queue = Mutex::new(items.into_iter());
    let failed = AtomicBool::new(false);
    let (tx, rx) = mpsc::channel::<Result<R, E>>();
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            let tx = tx.clone();
            let (queue, failed, work) = (&queue, &failed, &work);
            scope.spawn(move || {
                while !failed.load(Ordering::Relaxed) {
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                    let Some(item) = next else { return };
                    let result = work(item);
                    if result.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    if tx.send(result).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut first_error = None;
        for result in rx {
            match result {
                Ok(r) if first_error.is_none() => done(r),
                Ok(_) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn every_item_is_done_once_and_reported_here() {
        let here = std::thread::current().id();
        let mut seen = Vec::new();
        for_each(
            (0..100).collect(),
            4,
            |i: u32| Ok::<_, ()>((i, std::thread::current().id())),
            |(i, _)| {
                assert_eq!(std::thread::current().id(), here);
                seen.push(i);
            },
        )
        .unwrap();
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
    }

    /// After an error no new item starts; the error is what the call returns, and results that
    /// come after it are not reported. On one thread that is exact (items 0-3 started, 0-2
    /// reported); on several, another thread may start items until it sees the error (a bound
    /// on how many would be a race), so only the error returned is checked there.
    #[test]
    fn the_first_error_stops_the_queue() {
        for threads in [1, 2] {
            let started = AtomicUsize::new(0);
            let mut reported = 0;
            let err = for_each(
                (0..1000).collect(),
                threads,
                |i: u32| {
                    started.fetch_add(1, Ordering::Relaxed);
                    if i == 3 {
                        Err(format!("item {i}"))
                    } else {
                        Ok(i)
                    }
                },
                |_| reported += 1,
            )
            .unwrap_err();
            assert_eq!(err, "item 3");
            if threads == 1 {
                assert_eq!((started.load(Ordering::Relaxed), reported), (4, 3));
            }
        }
    }

    #[test]
    fn threads_are_bounded_by_the_items_and_the_maximum() {
        assert_eq!(threads_for(0, 8), 1);
        assert_eq!(threads_for(1, 8), 1);
        assert!(threads_for(100, 3) <= 3);
    }
}
