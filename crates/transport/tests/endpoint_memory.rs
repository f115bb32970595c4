//! An endpoint's heap. quinn sizes an endpoint's receive buffer as its
//! maximum UDP payload times the socket's GRO segment count times 32
//! slots: with loopback's 65,000-byte datagrams and Linux's 64 GRO
//! segments, 127 MiB per endpoint, of which no receive fills more than a
//! 64 KiB slot. The transport reports the segment count a slot needs
//! (`gso::receive_segments`), so a server and a client take a few MiB.
//!
//! The one test of this binary: the counting allocator sees every thread
//! of the process.

mod common;

use common::*;
use oar_transport::{DevCa, Transport};
use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering},
};

/// The system allocator, counting the bytes live and the largest block.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn taken(size: usize) {
    LIVE.fetch_add(size, Ordering::Relaxed);
    LARGEST.fetch_max(size, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            taken(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            taken(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            taken(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A server and a client on loopback (fixed 65,000-byte datagrams, the
/// default tuning), connected, one call answered: no block of 16 MiB or
/// more, under 32 MiB live in all (quinn alone took 2 x 127 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_and_a_client_endpoint_take_a_few_mib() {
    let ca = DevCa::new().unwrap();
    let before = LIVE.load(Ordering::SeqCst);
    LARGEST.store(0, Ordering::SeqCst);
    let server = start_server(&ca).await;
    let client = client(&ca, "c");
    let conn = client.connect(&server.addr()).await.unwrap();
    echo_ok(conn.as_ref(), 1).await;
    let live = LIVE.load(Ordering::SeqCst).saturating_sub(before);
    let largest = LARGEST.load(Ordering::SeqCst);
    eprintln!(
        "two endpoints and a connection: {:.1} MiB live, largest block {:.1} MiB",
        mib(live),
        mib(largest)
    );
    assert!(largest < 16 << 20, "a block of {:.1} MiB", mib(largest));
    assert!(live < 32 << 20, "{:.1} MiB live", mib(live));
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}
