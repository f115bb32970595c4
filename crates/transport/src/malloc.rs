//! glibc's malloc thresholds, raised once when a transport is made (issue 20).
//!
//! glibc returns the free memory at the top of a heap to the kernel once it
//! exceeds its *trim threshold*, 128 KiB at start. quinn receives every
//! datagram into a fresh buffer (65,000 bytes on loopback) and frees it
//! once the stream has taken its data, so a large transfer frees megabytes
//! at a time: glibc trims them, and the next datagrams fault the same pages
//! in again. On a VM where a page fault is dear that was 18% of a 256 MiB
//! call's CPU and a fifth of its time (BENCHMARKS.md, "glibc's trim
//! threshold").
//!
//! glibc raises the threshold by itself: freeing a block it had mapped
//! (larger than the *mmap threshold*, at most 32 MiB) sets the mmap
//! threshold to that block's size and the trim threshold to twice it
//! (`mallopt(3)`, "M_MMAP_THRESHOLD"). A process that frees one 8 MiB
//! buffer has raised them for good; one whose large buffers all stay in the
//! transport's [`BufferPool`](crate::wire::BufferPool) never gets there.
//! So the transport frees one block of
//! [`QuicOptions::glibc_mmap_threshold`](crate::QuicOptions::glibc_mmap_threshold)
//! bytes when it is made, and the process starts where the first such free
//! would have put it. Nothing else changes: the thresholds stay dynamic,
//! and glibc ignores the free if they were set (`mallopt`,
//! `GLIBC_TUNABLES`) or are already higher. Other allocators and C
//! libraries are left alone.

/// Free one block of `bytes` that glibc maps, so that its dynamic mmap
/// threshold rises to `bytes` and its trim threshold to twice that. A
/// no-op off glibc and for sizes glibc would not follow: at or under its
/// starting threshold (128 KiB), or over its cap (32 MiB).
pub(crate) fn raise_thresholds(bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if bytes > START_THRESHOLD && bytes <= MAX_DYNAMIC_THRESHOLD {
        // glibc maps the block as its size plus an 8-byte header, rounded
        // up to pages: asking a page less keeps that at most `bytes`, so
        // under the cap, or glibc would ignore the free.
        let size = bytes - 4096;
        // SAFETY: a plain malloc, and a free of the pointer it returned
        // (null included); the block is never read or written. The
        // pointer goes through `black_box`, or the compiler, which knows
        // malloc, drops the unused pair.
        unsafe { libc::free(std::hint::black_box(libc::malloc(size))) };
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = bytes;
}

/// glibc's mmap threshold at start (`DEFAULT_MMAP_THRESHOLD_MIN`, 128 KiB).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const START_THRESHOLD: usize = 128 << 10;

/// glibc's cap on the dynamic mmap threshold on 64-bit targets
/// (`DEFAULT_MMAP_THRESHOLD_MAX`, 32 MiB): larger frees do not move it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MAX_DYNAMIC_THRESHOLD: usize = 32 << 20;
