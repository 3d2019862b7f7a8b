//! Stand-ins for the device side of a session: a backend whose copies the test can hold, a
//! staging region with no memory behind it, and an event pool whose completions the test sets.

use std::any::Any;
use std::collections::HashSet;
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::mpsc;

use crate::backend::{
    Backend, BackendError, BackendKind, CopyJob, CopyTiming, DeviceInfo, DeviceRegion, EventPool,
    RegionExport,
};
use crate::mem::{HostPinner, PinAccess, PinError, PinGuard};

/// A copy as the backend saw it start: where it writes, how much, and which event it records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopySeen {
    pub offset: u64,
    pub bytes: u64,
    pub record: Option<u32>,
}

/// Copies do nothing but report that they started, then complete at once, or, while the gate
/// is held, once the test opens it (they are then "in flight" on the copy thread).
pub struct FakeBackend {
    held: Mutex<bool>,
    opened: Condvar,
    started: mpsc::UnboundedSender<CopySeen>,
}

impl FakeBackend {
    pub fn new(hold: bool) -> (Arc<FakeBackend>, mpsc::UnboundedReceiver<CopySeen>) {
        let (started, seen) = mpsc::unbounded_channel();
        let backend = FakeBackend {
            held: Mutex::new(hold),
            opened: Condvar::new(),
            started,
        };
        (Arc::new(backend), seen)
    }

    /// Lets every held copy, and every later one, complete.
    pub fn open(&self) {
        *self.held.lock().unwrap() = false;
        self.opened.notify_all();
    }
}

impl HostPinner for FakeBackend {
    fn pin_host(
        &self,
        _chunks: &[(usize, usize)],
        _access: PinAccess,
    ) -> Result<Option<PinGuard>, PinError> {
        Ok(None)
    }
}

impl Backend for FakeBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn devices(&self) -> Vec<DeviceInfo> {
        vec![DeviceInfo {
            uuid: "fake-0".into(),
            name: "fake device".into(),
            total_memory: 1 << 30,
            free_memory: 1 << 30,
            pci_bus_id: String::new(),
        }]
    }

    fn alignment(&self) -> u64 {
        256
    }

    fn alloc_region(
        &self,
        _device: usize,
        size: u64,
        _purpose: &'static str,
    ) -> Result<Arc<dyn DeviceRegion>, BackendError> {
        Ok(Arc::new(FakeRegion { size }))
    }

    fn copy(&self, _device: usize, job: CopyJob) -> Result<CopyTiming, BackendError> {
        let offset = job.spans.first().map_or(0, |(_, at)| *at);
        let seen = CopySeen {
            offset,
            bytes: job.bytes(),
            record: job.record,
        };
        let _ = self.started.send(seen);
        let held = self.held.lock().unwrap();
        drop(self.opened.wait_while(held, |held| *held).unwrap());
        Ok(CopyTiming::Done(std::time::Duration::ZERO))
    }

    fn synchronize(&self, _device: usize) -> Result<(), BackendError> {
        Ok(())
    }

    fn event_pool(
        &self,
        _device: usize,
        count: u32,
    ) -> Result<Option<Arc<dyn EventPool>>, BackendError> {
        Ok(Some(FakePool::new(count)))
    }
}

/// A staging region of `size` bytes with no memory behind it.
pub struct FakeRegion {
    pub size: u64,
}

impl DeviceRegion for FakeRegion {
    fn size(&self) -> u64 {
        self.size
    }

    fn export(&self) -> RegionExport {
        RegionExport::CudaIpc(Vec::new())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// `len` interprocess events; each is complete unless the test marks it pending.
pub struct FakePool {
    len: u32,
    pending: Mutex<HashSet<u32>>,
}

impl FakePool {
    pub fn new(len: u32) -> Arc<FakePool> {
        Arc::new(FakePool {
            len,
            pending: Mutex::default(),
        })
    }

    /// The work before event `index` (a client's reads) is still running, or done.
    pub fn set_pending(&self, index: u32, pending: bool) {
        let mut set = self.pending.lock().unwrap();
        if pending {
            set.insert(index);
        } else {
            set.remove(&index);
        }
    }
}

impl EventPool for FakePool {
    fn len(&self) -> u32 {
        self.len
    }

    fn handles(&self) -> Vec<Vec<u8>> {
        vec![Vec::new(); self.len as usize]
    }

    fn is_complete(&self, index: u32) -> bool {
        !self.pending.lock().unwrap().contains(&index)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
