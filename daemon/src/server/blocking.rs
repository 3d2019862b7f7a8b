//! Blocking work the edge runs off the async threads (loads, commits), each under a name, so
//! that a stop can say what it had to abandon: a blocking task cannot be cancelled (a read may
//! never return), and the process exits without it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::task::JoinHandle;

/// The blocking tasks still running, by what they do.
#[derive(Clone, Default)]
pub struct BlockingTasks {
    running: Arc<Mutex<BTreeMap<u64, String>>>,
    next: Arc<AtomicU64>,
}

/// Takes its task off the list when the task ends, however it ends.
struct Listed {
    tasks: BlockingTasks,
    id: u64,
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.tasks.lock().remove(&self.id);
    }
}

impl BlockingTasks {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, String>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on tokio's blocking pool, listed as `what` until it returns.
    pub fn spawn<R: Send + 'static>(
        &self,
        what: impl Into<String>,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> JoinHandle<R> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, what.into());
        let listed = Listed {
            tasks: self.clone(),
            id,
        };
        tokio::task::spawn_blocking(move || {
            let _listed = listed;
            f()
        })
    }

    /// What is still running, oldest first.
    pub fn running(&self) -> Vec<String> {
        self.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_is_listed_until_it_returns() {
        let tasks = BlockingTasks::default();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let held = tasks.spawn("held", move || wait.recv());
        let done = tasks.spawn("quick", || 7);
        assert_eq!(done.await.unwrap(), 7);
        assert_eq!(tasks.running(), vec!["held".to_string()]);
        release.send(()).unwrap();
        held.await.unwrap().unwrap();
        assert!(tasks.running().is_empty());
    }
}
