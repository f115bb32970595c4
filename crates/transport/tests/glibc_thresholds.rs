//! A transport raises glibc's dynamic mmap threshold when it is made
//! (`QuicOptions::glibc_mmap_threshold`), so that the megabytes of quinn's
//! per-datagram buffers a large transfer frees stay mapped instead of being
//! trimmed and faulted in again.
//!
//! The one test of this binary: glibc's thresholds belong to the process
//! and only ever rise, so each step is checked in order, in a process of
//! its own.
#![cfg(all(target_os = "linux", target_env = "gnu"))]

use oar_transport::{DevCa, QuicOptions, QuicTransport};

/// Whether glibc maps a fresh 1 MiB block on its own (above its mmap
/// threshold) rather than carving it from a heap: the count of mapped
/// blocks rises while it is held. A mapped block is never freed: freeing
/// it would itself raise the threshold to 1 MiB (1 MiB leaked per probe).
fn one_mib_is_mapped() -> bool {
    // SAFETY: mallinfo2 only reads glibc's counters; the block is never
    // touched. `black_box` keeps the compiler from dropping the malloc.
    unsafe {
        let before = libc::mallinfo2().hblks;
        let block = std::hint::black_box(libc::malloc(1 << 20));
        assert!(!block.is_null(), "malloc of 1 MiB failed");
        let mapped = libc::mallinfo2().hblks > before;
        if !mapped {
            libc::free(block);
        }
        mapped
    }
}

#[test]
fn a_transport_raises_glibcs_mmap_threshold_unless_told_not_to() {
    let ca = DevCa::new().expect("CA");
    let (tls_off, tls_default) = (ca.tls_config("off").expect("tls"), ca.tls_config("default").expect("tls"));
    assert!(one_mib_is_mapped(), "at start glibc maps blocks over 128 KiB on their own");

    let off = QuicOptions { glibc_mmap_threshold: 0, ..QuicOptions::default() };
    let _left_alone = QuicTransport::with_options(tls_off, off).expect("transport");
    assert!(one_mib_is_mapped(), "a transport with glibc_mmap_threshold 0 changed glibc's threshold");

    let _default = QuicTransport::new(tls_default).expect("transport");
    assert!(
        !one_mib_is_mapped(),
        "after a transport with the default options glibc still maps a 1 MiB block on its own"
    );
}
