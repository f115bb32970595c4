//! Receive buffers kept for reuse (issue 20).
//!
//! A frame's payload is received into one buffer of its declared size
//! (a fresh one reserves at most [`RESERVE_AHEAD`] before its bytes come,
//! and grows with them). A
//! fresh buffer of 64–256 MiB is a fresh `mmap`: its first write faults
//! every page in (and the kernel zeroes it), and freeing it is a `munmap`;
//! that was 38% of a large call's CPU (BENCHMARKS.md, "Profile before
//! changes"). A pool hands the next frame a buffer that is already mapped.

use bytes::Bytes;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::{Error, Result};

/// Payloads from this size up (4 MiB) are received into pooled buffers by
/// default. glibc's malloc maps a buffer this large afresh, or takes it
/// from a thread arena that it trims again once the buffer is freed: either
/// way every call faults its memory in anew (a pserver's 8 MiB push parts:
/// 3% of `bench_push_pull`'s CPU in faults). Pooling from 64 KiB made
/// 4 MiB calls slower: glibc's mmap threshold, which follows freed
/// buffers, then never rose, and glibc kept handing quinn's per-datagram
/// buffers back to the kernel (up to 5x the page faults). Pooling from
/// 4 MiB left calls of 4 MiB as fast as before, with as many faults
/// (BENCHMARKS.md, "Pooled buffers for 8 MiB parts"). Since a pooled buffer
/// is never freed, a process whose large buffers all stay here never
/// raises glibc's threshold either: a transport raises it to this size when
/// it is made ([`QuicOptions::glibc_mmap_threshold`](crate::QuicOptions::glibc_mmap_threshold)).
pub const DEFAULT_POOLED_FROM: usize = 4 << 20;

/// At most this many buffers are kept idle, whatever their sizes: it bounds
/// the search for a fitting one.
const MAX_IDLE_BUFFERS: usize = 16;

/// A fresh receive buffer reserves at most this much (16 MiB) before its
/// bytes arrive, and then grows with them (doubling, up to the declared
/// size). A header is only a claim: reserving all of it at once let a peer
/// with a valid certificate reserve `max_message` (1 GiB) per stream,
/// hundreds of streams per connection, by sending headers alone. Frames up
/// to this size (a trainer's 8 MiB push parts among them) still get one
/// buffer of exactly their size; a larger one grows a handful of times, and
/// glibc moves a mapped block with `mremap` rather than copying it. A kept
/// buffer from the pool is lent whole: its memory is the pool's already.
pub const RESERVE_AHEAD: usize = 16 << 20;

/// Large receive buffers kept for reuse, so that a large frame lands in
/// memory that is already mapped and faulted in.
///
/// A decoder made with [`Decoder::with_pool`](crate::wire::Decoder::with_pool)
/// borrows a buffer once the frame's header has been checked, and the
/// frame's payload [`Bytes`] owns it; when the last `Bytes` of that payload
/// is dropped (the handler is done with it), the buffer goes back to the
/// pool. A frame is only given a buffer of at most twice its size, so a
/// payload kept for long never pins much more than itself.
///
/// Memory bound: the pool keeps at most `max_idle_bytes` of idle buffers
/// (counted by capacity), and at most 16 of them; a returned buffer that
/// would go over evicts the least recently returned ones, and a buffer
/// larger than the bound is freed at once. Buffers lent out belong to their
/// frames and are not counted, so the pool adds at most `max_idle_bytes`
/// to what the process would hold without it. Clones share one pool.
#[derive(Clone, Debug)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    max_idle_bytes: usize,
    pooled_from: usize,
    idle: Mutex<Idle>,
}

/// The idle buffers, least recently returned first, and their capacities summed.
#[derive(Debug, Default)]
struct Idle {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `max_idle_bytes` of idle buffers, for
    /// payloads of [`DEFAULT_POOLED_FROM`] bytes and more. With 0 nothing
    /// is ever kept: each frame gets a fresh buffer, as without a pool.
    pub fn new(max_idle_bytes: usize) -> BufferPool {
        BufferPool {
            inner: Arc::new(PoolInner {
                max_idle_bytes,
                pooled_from: DEFAULT_POOLED_FROM,
                idle: Mutex::new(Idle::default()),
            }),
        }
    }

    /// The same bound, pooling payloads of `bytes` and more (tests and the
    /// fuzzer use 0 to send small frames through the pool too).
    pub fn pooling_from(self, bytes: usize) -> BufferPool {
        let max_idle_bytes = self.inner.max_idle_bytes;
        BufferPool {
            inner: Arc::new(PoolInner {
                max_idle_bytes,
                pooled_from: bytes,
                idle: Mutex::new(Idle::default()),
            }),
        }
    }

    /// The capacity of the idle buffers, summed (never above the bound).
    pub fn idle_bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    /// How many buffers are idle.
    pub fn idle_buffers(&self) -> usize {
        self.inner.lock().buffers.len()
    }

    /// A buffer to assemble an outgoing payload in, with room for
    /// `capacity` bytes: an idle one that fits, or a fresh one (as for a
    /// received frame). [`PooledBuf::freeze`] makes it the payload's
    /// [`Bytes`], and the buffer comes back when the last clone is dropped
    /// (for a reply, once the peer has acknowledged it). An error instead
    /// of an abort when memory is short.
    pub fn writer(&self, capacity: usize) -> Result<PooledBuf> {
        self.take(capacity as u64, capacity).map(PooledBuf)
    }

    /// An empty buffer for a received payload of `len` bytes: an idle one
    /// that fits (the smallest of at most twice `len`), or a fresh one that
    /// reserves at most [`RESERVE_AHEAD`] and grows as the bytes arrive
    /// ([`Lent::extend`]). An error instead of an abort when memory is short.
    pub(crate) fn take_for_receive(&self, len: u64) -> Result<Lent> {
        self.take(len, RESERVE_AHEAD)
    }

    /// An idle buffer that fits `len` bytes, or a fresh one reserving
    /// `len`, but at most `reserve`, bytes.
    fn take(&self, len: u64, reserve: usize) -> Result<Lent> {
        let inner = &self.inner;
        let fits_pool =
            usize::try_from(len).is_ok_and(|n| n >= inner.pooled_from && n <= inner.max_idle_bytes);
        if !fits_pool {
            return Lent::own(len, reserve);
        }
        let n = len as usize;
        let reused = {
            let mut idle = inner.lock();
            let best = idle
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= n && b.capacity() / 2 <= n)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| {
                let buffer = idle.buffers.remove(i);
                idle.bytes -= buffer.capacity();
                buffer
            })
        };
        let buffer = match reused {
            Some(mut buffer) => {
                buffer.clear();
                buffer
            }
            None => reserve_for(len, reserve)?,
        };
        Ok(Lent { buffer, declared: n, pool: Arc::downgrade(inner) })
    }
}

impl PoolInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keep `buffer` for reuse, within the bounds.
    fn put(&self, buffer: Vec<u8>) {
        let capacity = buffer.capacity();
        if capacity == 0 || capacity > self.max_idle_bytes {
            return;
        }
        let evicted = {
            let mut idle = self.lock();
            idle.buffers.push(buffer);
            idle.bytes += capacity;
            let mut over = 0;
            let mut freed = 0;
            while idle.bytes - freed > self.max_idle_bytes || idle.buffers.len() - over > MAX_IDLE_BUFFERS {
                freed += idle.buffers[over].capacity();
                over += 1;
            }
            idle.bytes -= freed;
            idle.buffers.drain(..over).collect::<Vec<_>>()
        };
        // Freed outside the lock: a munmap of a large buffer takes a while.
        drop(evicted);
    }
}

/// An empty buffer for `len` bytes that reserves `len`, but at most
/// `reserve`, bytes now; an error instead of an abort when memory is short.
pub(crate) fn reserve_for(len: u64, reserve: usize) -> Result<Vec<u8>> {
    let n = usize::try_from(len).map_err(|_| Error::OutOfMemory { bytes: len })?;
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(n.min(reserve)).map_err(|_| Error::OutOfMemory { bytes: len })?;
    Ok(v)
}

/// Make room in `buffer`, bound for `declared` bytes in all, for `more`
/// bytes: at least double its capacity (at least [`RESERVE_AHEAD`]), never
/// past `declared`. So a buffer holds at most twice what has arrived, or
/// `RESERVE_AHEAD`, whichever is larger, and grows O(log) times.
pub(crate) fn grow_for(buffer: &mut Vec<u8>, declared: usize, more: usize) -> Result<()> {
    let needed = buffer.len() + more;
    if needed <= buffer.capacity() {
        return Ok(());
    }
    let target = needed.max(buffer.capacity().saturating_mul(2)).max(RESERVE_AHEAD).min(declared.max(needed));
    buffer.try_reserve_exact(target - buffer.len()).map_err(|_| Error::OutOfMemory { bytes: declared as u64 })
}

/// An outgoing payload being assembled in a buffer from a [`BufferPool`]
/// ([`BufferPool::writer`]).
#[derive(Debug)]
pub struct PooledBuf(Lent);

impl PooledBuf {
    /// Append `bytes` (growing the buffer past its capacity if need be).
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.0.buffer.extend_from_slice(bytes);
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// What was written, as one [`Bytes`] that owns the buffer.
    pub fn freeze(self) -> Bytes {
        self.0.into_bytes()
    }
}

/// A payload buffer being filled by a decoder: lent by a pool (and given
/// back to it when dropped), or a buffer of its own.
pub(crate) struct Lent {
    buffer: Vec<u8>,
    /// The payload's declared size: the buffer never grows past it.
    declared: usize,
    /// The pool to give the buffer back to; dangling for a buffer of its own.
    pool: Weak<PoolInner>,
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lent")
            .field("len", &self.buffer.len())
            .field("capacity", &self.buffer.capacity())
            .field("pooled", &(self.pool.strong_count() > 0))
            .finish()
    }
}

impl Lent {
    /// No buffer at all (before the header is in, or when there is no payload to keep).
    pub(crate) fn none() -> Lent {
        Lent { buffer: Vec::new(), declared: 0, pool: Weak::new() }
    }

    /// A buffer of its own for `len` bytes, reserving at most `reserve` of them now.
    pub(crate) fn own(len: u64, reserve: usize) -> Result<Lent> {
        let buffer = reserve_for(len, reserve)?;
        Ok(Lent { buffer, declared: len as usize, pool: Weak::new() })
    }

    pub(crate) fn len(&self) -> usize {
        self.buffer.len()
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.buffer.capacity()
    }

    /// Append `bytes`, growing the buffer towards its declared size as
    /// they arrive ([`grow_for`]); an error when memory is short.
    pub(crate) fn extend(&mut self, bytes: &[u8]) -> Result<()> {
        grow_for(&mut self.buffer, self.declared, bytes.len())?;
        self.buffer.extend_from_slice(bytes);
        Ok(())
    }

    /// The filled part as [`Bytes`]: owning the buffer (which returns to
    /// its pool when the last clone is dropped), or the buffer itself.
    pub(crate) fn into_bytes(mut self) -> Bytes {
        if self.pool.strong_count() > 0 {
            Bytes::from_owner(self)
        } else {
            Bytes::from(std::mem::take(&mut self.buffer))
        }
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.put(std::mem::take(&mut self.buffer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(pool: &BufferPool, len: usize) -> Bytes {
        let mut lent = pool.take_for_receive(len as u64).unwrap();
        lent.extend(&vec![7u8; len]).unwrap();
        lent.into_bytes()
    }

    #[test]
    fn a_returned_buffer_is_reused_for_the_next_frame_that_fits() {
        let pool = BufferPool::new(1 << 20).pooling_from(0);
        let a = filled(&pool, 1000);
        let first = a.as_ptr();
        assert_eq!(pool.idle_buffers(), 0, "lent out, not idle");
        let b = a.clone();
        drop(a);
        assert_eq!(pool.idle_buffers(), 0, "a clone still holds it");
        drop(b);
        assert_eq!((pool.idle_buffers(), pool.idle_bytes()), (1, 1000));
        // Same size, and smaller down to half: the same memory again.
        let c = filled(&pool, 600);
        assert_eq!(c.as_ptr(), first);
        assert_eq!(c.len(), 600);
        drop(c);
        // Less than half: a buffer of its own, the big one stays idle.
        let d = filled(&pool, 400);
        assert_ne!(d.as_ptr(), first);
        assert_eq!(pool.idle_buffers(), 1);
    }

    #[test]
    fn idle_memory_stays_within_the_bound() {
        let pool = BufferPool::new(3000).pooling_from(0);
        let held: Vec<Bytes> = (0..5).map(|_| filled(&pool, 1000)).collect();
        drop(held);
        assert_eq!((pool.idle_buffers(), pool.idle_bytes()), (3, 3000));
        // Larger than the bound: never kept.
        drop(filled(&pool, 5000));
        assert_eq!(pool.idle_bytes(), 3000);
        // A newer buffer evicts the least recently returned.
        drop(filled(&pool, 2500));
        assert_eq!((pool.idle_buffers(), pool.idle_bytes()), (1, 2500));
        let many = BufferPool::new(1 << 30).pooling_from(0);
        let held: Vec<Bytes> = (0..40).map(|_| filled(&many, 10)).collect();
        drop(held);
        assert_eq!(many.idle_buffers(), MAX_IDLE_BUFFERS);
    }

    #[test]
    fn small_frames_and_a_zero_bound_bypass_the_pool() {
        let pool = BufferPool::new(1 << 20);
        drop(filled(&pool, 1000));
        assert_eq!(pool.idle_buffers(), 0, "below DEFAULT_POOLED_FROM");
        let off = BufferPool::new(0).pooling_from(0);
        drop(filled(&off, 1000));
        assert_eq!(off.idle_buffers(), 0);
    }

    #[test]
    fn a_written_payload_gives_its_buffer_back_once_dropped() {
        let pool = BufferPool::new(1 << 20).pooling_from(0);
        let mut out = pool.writer(1000).unwrap();
        assert!(out.is_empty());
        out.extend_from_slice(&[1; 600]);
        out.extend_from_slice(&[2; 400]);
        assert_eq!(out.len(), 1000);
        let first = out.freeze();
        let at = first.as_ptr();
        assert_eq!((first[599], first[600], first.len()), (1, 2, 1000));
        assert_eq!(pool.idle_buffers(), 0, "lent out while the payload lives");
        drop(first);
        assert_eq!(pool.idle_buffers(), 1);
        // The next payload that fits is written into the same memory.
        let mut again = pool.writer(800).unwrap();
        again.extend_from_slice(&[3; 800]);
        let again = again.freeze();
        assert_eq!(again.as_ptr(), at);
        assert!(again.iter().all(|b| *b == 3));
        // Written past its capacity, a buffer grows rather than failing.
        let mut grown = BufferPool::new(0).writer(4).unwrap();
        grown.extend_from_slice(&[9; 10]);
        assert_eq!(grown.freeze().len(), 10);
    }

    #[test]
    fn a_buffer_outliving_its_pool_is_just_freed() {
        let pool = BufferPool::new(1 << 20).pooling_from(0);
        let b = filled(&pool, 100);
        drop(pool);
        assert_eq!(b.len(), 100);
        drop(b);
    }
}
