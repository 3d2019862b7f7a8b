//! The daemon's heap after a large request. A BeginUpload of a million tensors is tens of MB
//! on the wire and ten times that decoded and checked: a million small allocations, freed when
//! the request ends. glibc keeps freed memory in its arenas (a thread's arena is trimmed only
//! from its top), so the daemon's resident size stayed ~100 MB above where it was before one
//! such request; `malloc_trim` returns every free page of every arena to the kernel.

/// Requests declaring at least this many tensors give their memory back when they end.
pub const LARGE_REQUEST_TENSORS: usize = 65_536;

/// Returns the heap's free pages to the kernel (glibc; elsewhere, where the allocator has no
/// such call, nothing).
pub fn give_back_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers and only walks glibc's own arenas, under their
    // locks; any thread may call it at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
