//! Host bytes promised to a load or upload that is being made ([`Pending`]), held by a
//! [`Reservation`] until what they stand for counts itself. The registry keeps the promises and
//! makes them (`Store::reserve`); loads and uploads hold them.

use super::Store;

/// Host bytes promised to a load or upload that is being made: counted like the real thing so
/// that two requests at once cannot both pass a quota.
pub(super) struct Pending {
    pub(super) uid: u32,
    pub(super) bytes: u64,
    pub(super) upload: bool,
}

/// A `Pending` entry, removed on drop (the model or upload it stood for now counts itself, or
/// was never made).
pub(super) struct Reservation<'a> {
    pub(super) store: &'a Store,
    pub(super) id: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.store.inner().remove_pending(self.id);
    }
}
