//! The wire format: how one [`Frame`] travels on one QUIC stream. Pure code,
//! no I/O, so it can be tested exhaustively and fuzzed.
//!
//! A stream carries one call or, when its requests say so, a run of calls
//! one after another:
//!
//! - **One call** (the default): each direction carries exactly one frame
//!   and then ends; a reader reads to the stream's end.
//! - **A kept stream**: every request carries the [`FLAG_KEEP`] flag, and
//!   a frame ends where its header's lengths say. The server answers each
//!   request without ending its side and reads the next one; the client
//!   sends the next request only once it has read the reply, so a stream
//!   never holds two calls. Either end retires it at a frame boundary, by
//!   finishing its side (a server that retires one also stops reading it:
//!   a request that meets a retired stream was not handled). A request
//!   without the flag on a kept stream is its last call. Small calls take
//!   this form: a stream opened, finished and acknowledged per call is
//!   work quinn does per call (BENCHMARKS.md, "Kept streams").
//!
//! ```text
//! offset size  field
//!      0    4  magic "OARF"
//!      4    2  protocol version, u16 little-endian (PROTOCOL_VERSION)
//!      6    1  kind: 1 request, 2 response, 3 error (metadata = postcard RemoteError)
//!      7    1  flags: 0, or on a request FLAG_KEEP (1); other bits reserved
//!      8    2  method, u16 little-endian
//!     10    4  metadata length, u32 little-endian
//!     14    8  payload length, u64 little-endian
//!     22    …  metadata bytes, then payload bytes (raw little-endian f32 by convention)
//! ```
//!
//! The [`Decoder`] checks magic, version, kind, flags and both lengths
//! against the maximum message size as soon as the 22 header bytes are in,
//! *before* allocating anything; then it allocates the metadata and the
//! payload buffers once each, at their declared (already checked) sizes,
//! copies received chunks into them and freezes them into the frame's
//! [`Bytes`]. A payload is never decoded element by element. A decoder
//! made with [`Decoder::with_pool`] takes the payload's buffer from a
//! [`BufferPool`] instead (the same checks come first), and the frame's
//! payload gives it back when dropped.

use crate::pool::{grow_for, reserve_for, Lent};
pub use crate::pool::{BufferPool, PooledBuf, DEFAULT_POOLED_FROM, RESERVE_AHEAD};
use crate::{Error, Frame, Result};
use bytes::{Bytes, BytesMut};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"OARF";
/// The version of this wire format; a peer with another version is refused
/// with [`Error::VersionMismatch`], which names both.
///
/// Version 2 added [`FLAG_KEEP`]; a version 1 peer refuses it, so the
/// version says so first.
pub const PROTOCOL_VERSION: u16 = 2;
/// The request's flag for a kept stream (see the module docs).
pub const FLAG_KEEP: u8 = 1;
/// Size of the fixed header.
pub const HEADER_LEN: usize = 22;
/// Default maximum of metadata plus payload bytes in one frame (1 GiB,
/// room for a 256M-float tensor).
pub const DEFAULT_MAX_MESSAGE: u64 = 1 << 30;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// A call's request.
    Request = 1,
    /// A successful answer.
    Response = 2,
    /// A failed answer: the metadata is a postcard-encoded [`crate::RemoteError`].
    Error = 3,
}

impl Kind {
    fn from_byte(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::Request),
            2 => Some(Kind::Response),
            3 => Some(Kind::Error),
            _ => None,
        }
    }
}

/// Which frames a reader accepts: a server reads requests, a client replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Only [`Kind::Request`].
    Request,
    /// [`Kind::Response`] or [`Kind::Error`].
    Reply,
}

impl Expect {
    fn allows(self, kind: Kind) -> bool {
        match self {
            Expect::Request => kind == Kind::Request,
            Expect::Reply => kind != Kind::Request,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Expect::Request => "a request (1)",
            Expect::Reply => "a response (2) or an error (3)",
        }
    }
}

/// The fixed header of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// The method number.
    pub method: u16,
    /// Metadata bytes following the header.
    pub meta_len: u32,
    /// Payload bytes following the metadata.
    pub payload_len: u64,
    /// [`FLAG_KEEP`]: a request on a kept stream (always `false` on a reply).
    pub keep: bool,
}

impl Header {
    /// The header of `frame` sent as `kind`; fails if the metadata does not fit a u32 length.
    pub fn of(kind: Kind, frame: &Frame) -> Result<Header> {
        let meta_len = u32::try_from(frame.meta.len()).map_err(|_| Error::TooLarge {
            meta: frame.meta.len() as u64,
            payload: frame.payload.len() as u64,
            claimed: (frame.meta.len() as u64).saturating_add(frame.payload.len() as u64),
            max: u64::from(u32::MAX),
        })?;
        Ok(Header {
            kind,
            method: frame.method,
            meta_len,
            payload_len: frame.payload.len() as u64,
            keep: false,
        })
    }

    /// Metadata plus payload bytes (saturating).
    pub fn body_len(&self) -> u64 {
        u64::from(self.meta_len).saturating_add(self.payload_len)
    }

    /// The header's bytes, stamped with [`MAGIC`] and [`PROTOCOL_VERSION`].
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6] = self.kind as u8;
        b[7] = if self.keep { FLAG_KEEP } else { 0 };
        b[8..10].copy_from_slice(&self.method.to_le_bytes());
        b[10..14].copy_from_slice(&self.meta_len.to_le_bytes());
        b[14..22].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parse and check a header: magic, version, kind against `expect`,
    /// flags, and the declared lengths against `max_message`. Allocates nothing.
    pub fn parse(b: &[u8; HEADER_LEN], expect: Expect, max_message: u64) -> Result<Header> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(Error::BadMagic { expected: MAGIC, got: magic });
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != PROTOCOL_VERSION {
            return Err(Error::VersionMismatch { ours: PROTOCOL_VERSION, theirs: version });
        }
        let kind = Kind::from_byte(b[6])
            .filter(|k| expect.allows(*k))
            .ok_or(Error::BadKind { expected: expect.describe(), got: b[6] })?;
        let keep = match b[7] {
            0 => false,
            FLAG_KEEP if kind == Kind::Request => true,
            got => return Err(Error::BadFlags { got }),
        };
        let header = Header {
            kind,
            method: u16::from_le_bytes([b[8], b[9]]),
            meta_len: u32::from_le_bytes([b[10], b[11], b[12], b[13]]),
            payload_len: u64::from_le_bytes([b[14], b[15], b[16], b[17], b[18], b[19], b[20], b[21]]),
            keep,
        };
        if header.body_len() > max_message {
            return Err(Error::TooLarge {
                meta: u64::from(header.meta_len),
                payload: header.payload_len,
                claimed: header.body_len(),
                max: max_message,
            });
        }
        Ok(header)
    }
}

/// The bytes to send for `frame` as `kind`: a small buffer with the header
/// and the metadata, and the payload [`Bytes`] itself (shared, not copied).
pub fn encode(kind: Kind, frame: &Frame) -> Result<[Bytes; 2]> {
    Ok(encode_with(Header::of(kind, frame)?, frame))
}

/// As [`encode`], with `header` as given: for a sender that sends the
/// payload itself, from elsewhere, and declares its length in the header.
pub fn encode_with(header: Header, frame: &Frame) -> [Bytes; 2] {
    let mut head = BytesMut::with_capacity(HEADER_LEN + frame.meta.len());
    head.extend_from_slice(&header.to_bytes());
    head.extend_from_slice(&frame.meta);
    [head.freeze(), frame.payload.clone()]
}

/// Incremental decoder of one frame, fed with the chunks a stream delivers.
///
/// After [`Decoder::feed`] returns an error the decoder is spent: drop it.
#[derive(Debug)]
pub struct Decoder {
    expect: Expect,
    max_message: u64,
    head: [u8; HEADER_LEN],
    head_filled: usize,
    header: Option<Header>,
    /// Grows as it arrives, as the payload's buffer does (see [`RESERVE_AHEAD`]).
    meta: Vec<u8>,
    payload: Lent,
    /// Where a kept payload's buffer comes from; `None`: a fresh one.
    pool: Option<BufferPool>,
    /// The payload is handed to the caller ([`Decoder::feed_streaming`]),
    /// not kept.
    streaming: bool,
    /// Payload bytes taken in so far.
    payload_seen: u64,
}

impl Decoder {
    /// A decoder accepting `expect` frames of at most `max_message` bytes of metadata plus payload.
    pub fn new(expect: Expect, max_message: u64) -> Decoder {
        Decoder {
            expect,
            max_message,
            head: [0; HEADER_LEN],
            head_filled: 0,
            header: None,
            meta: Vec::new(),
            payload: Lent::none(),
            pool: None,
            streaming: false,
            payload_seen: 0,
        }
    }

    /// As [`new`](Self::new), receiving the payload into a buffer from
    /// `pool` (taken only once the header has passed every check), which
    /// the frame's payload gives back when its last [`Bytes`] is dropped.
    pub fn with_pool(expect: Expect, max_message: u64, pool: BufferPool) -> Decoder {
        Decoder { pool: Some(pool), ..Decoder::new(expect, max_message) }
    }

    /// A decoder that keeps the header and metadata but hands each piece
    /// of the payload back from [`feed_streaming`](Self::feed_streaming), so
    /// the caller can put it where it belongs without a buffer of the
    /// payload's size; [`finish`](Self::finish) then gives an empty payload.
    pub fn streaming(expect: Expect, max_message: u64) -> Decoder {
        Decoder { streaming: true, ..Decoder::new(expect, max_message) }
    }

    /// The header, once its bytes are in and checked.
    pub fn header(&self) -> Option<&Header> {
        self.header.as_ref()
    }

    /// Bytes still missing before the frame is complete (0 when it is).
    pub fn remaining(&self) -> u64 {
        match &self.header {
            None => (HEADER_LEN - self.head_filled) as u64,
            Some(h) => {
                let meta_left = u64::from(h.meta_len) - self.meta.len() as u64;
                meta_left + (h.payload_len - self.payload_seen)
            }
        }
    }

    /// Whether a whole frame has been received.
    pub fn is_complete(&self) -> bool {
        self.header.is_some() && self.remaining() == 0
    }

    /// Take in the next bytes of the stream. Checks the header as soon as it
    /// is complete; bytes beyond the end of the frame are an error.
    pub fn feed(&mut self, input: &[u8]) -> Result<()> {
        let payload = self.take(input)?;
        if !self.streaming {
            self.payload.extend(payload)?;
        }
        Ok(())
    }

    /// As [`feed`](Self::feed), returning the part of `input` that is
    /// payload (for a decoder made by [`streaming`](Self::streaming), which
    /// does not keep it). The header, once [`header`](Self::header) has it,
    /// says how much payload is coming.
    pub fn feed_streaming<'i>(&mut self, input: &'i [u8]) -> Result<&'i [u8]> {
        self.take(input)
    }

    /// Consume header and metadata bytes of `input`; return its payload bytes.
    fn take<'i>(&mut self, mut input: &'i [u8]) -> Result<&'i [u8]> {
        if self.header.is_none() {
            let take = (HEADER_LEN - self.head_filled).min(input.len());
            self.head[self.head_filled..self.head_filled + take].copy_from_slice(&input[..take]);
            self.head_filled += take;
            input = &input[take..];
            if self.head_filled < HEADER_LEN {
                return Ok(&[]);
            }
            let header = Header::parse(&self.head, self.expect, self.max_message)?;
            // Lengths are checked: now allocate each buffer at its size, or
            // up to RESERVE_AHEAD of it and grow it as its bytes arrive.
            self.meta = reserve_for(u64::from(header.meta_len), RESERVE_AHEAD)?;
            if !self.streaming {
                self.payload = match &self.pool {
                    Some(pool) => pool.take_for_receive(header.payload_len)?,
                    None => Lent::own(header.payload_len, RESERVE_AHEAD)?,
                };
            }
            self.header = Some(header);
        }
        let Some(header) = self.header else { return Ok(&[]) };
        let meta_left = header.meta_len as usize - self.meta.len();
        let take = meta_left.min(input.len());
        grow_for(&mut self.meta, header.meta_len as usize, take)?;
        self.meta.extend_from_slice(&input[..take]);
        input = &input[take..];
        let payload_left = header.payload_len - self.payload_seen;
        let take = usize::try_from(payload_left).unwrap_or(usize::MAX).min(input.len());
        let (payload, rest) = input.split_at(take);
        self.payload_seen += take as u64;
        if !rest.is_empty() {
            return Err(Error::TrailingData { extra: rest.len() as u64 });
        }
        Ok(payload)
    }

    /// The stream has ended: the complete frame, or [`Error::Truncated`]
    /// naming the part that was cut short.
    pub fn finish(self) -> Result<(Kind, Frame)> {
        let Some(header) = self.header else {
            return Err(Error::Truncated {
                part: "header",
                expected: HEADER_LEN as u64,
                got: self.head_filled as u64,
            });
        };
        if self.meta.len() < header.meta_len as usize {
            return Err(Error::Truncated {
                part: "metadata",
                expected: u64::from(header.meta_len),
                got: self.meta.len() as u64,
            });
        }
        if self.payload_seen < header.payload_len {
            return Err(Error::Truncated {
                part: "payload",
                expected: header.payload_len,
                got: self.payload_seen,
            });
        }
        debug_assert!(self.streaming || self.payload.len() as u64 == header.payload_len);
        let frame =
            Frame { method: header.method, meta: Bytes::from(self.meta), payload: self.payload.into_bytes() };
        Ok((header.kind, frame))
    }
}

/// Decode one whole frame from `bytes` (the complete content of a stream).
pub fn decode(bytes: &[u8], expect: Expect, max_message: u64) -> Result<(Kind, Frame)> {
    let mut decoder = Decoder::new(expect, max_message);
    decoder.feed(bytes)?;
    decoder.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Frame {
        Frame::new(7, &("meta", 42u32), crate::f32s_to_bytes(&[1.0, -2.5, 3.25])).unwrap()
    }

    fn bytes_of(kind: Kind, frame: &Frame) -> Vec<u8> {
        encode(kind, frame).unwrap().concat()
    }

    /// [`decode`] through a pooled decoder (every payload size pooled).
    fn decode_pooled(bytes: &[u8], expect: Expect, max: u64, pool: &BufferPool) -> Result<(Kind, Frame)> {
        let mut decoder = Decoder::with_pool(expect, max, pool.clone());
        decoder.feed(bytes)?;
        decoder.finish()
    }

    #[test]
    fn a_pooled_decoder_reuses_the_buffer_once_the_payload_is_dropped() {
        let pool = BufferPool::new(1 << 20).pooling_from(0);
        let frame = Frame { method: 3, meta: Bytes::new(), payload: Bytes::from(vec![5u8; 1000]) };
        let b = bytes_of(Kind::Request, &frame);
        let (_, first) = decode_pooled(&b, Expect::Request, 4096, &pool).unwrap();
        assert_eq!(first, frame);
        let at = first.payload.as_ptr();
        drop(first);
        assert_eq!(pool.idle_buffers(), 1);
        let (_, second) = decode_pooled(&b, Expect::Request, 4096, &pool).unwrap();
        assert_eq!(second.payload.as_ptr(), at, "the same memory again");
        assert_eq!(second, frame);
        // A malformed frame gives its buffer back too, and never shows
        // what an earlier frame left in it.
        drop(second);
        let short = bytes_of(Kind::Request, &Frame { payload: Bytes::from(vec![9u8; 900]), ..frame.clone() });
        let mut decoder = Decoder::with_pool(Expect::Request, 4096, pool.clone());
        decoder.feed(&short[..short.len() - 10]).unwrap();
        assert!(matches!(decoder.finish(), Err(Error::Truncated { part: "payload", .. })));
        assert_eq!(pool.idle_buffers(), 1);
        let (_, third) = decode_pooled(&short, Expect::Request, 4096, &pool).unwrap();
        assert_eq!(third.payload.as_ptr(), at);
        assert_eq!(third.payload.as_ref(), &[9u8; 900][..]);
    }

    #[test]
    fn round_trip_and_payload_is_shared_not_copied() {
        let frame = sample();
        let [head, payload] = encode(Kind::Request, &frame).unwrap();
        assert_eq!(head.len(), HEADER_LEN + frame.meta.len());
        assert_eq!(payload.as_ptr(), frame.payload.as_ptr(), "payload must be sent as is");
        let (kind, back) = decode(&bytes_of(Kind::Request, &frame), Expect::Request, 1024).unwrap();
        assert_eq!(kind, Kind::Request);
        assert_eq!(back, frame);
    }

    #[test]
    fn header_layout_is_fixed() {
        let h =
            Header { kind: Kind::Response, method: 0x0102, meta_len: 3, payload_len: 0x0a0b, keep: false };
        let b = h.to_bytes();
        assert_eq!(&b[0..4], b"OARF");
        assert_eq!(&b[4..6], &PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(b[6], 2);
        assert_eq!(b[7], 0);
        assert_eq!(&b[8..10], &[0x02, 0x01]);
        assert_eq!(&b[10..14], &[3, 0, 0, 0]);
        assert_eq!(&b[14..22], &[0x0b, 0x0a, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn wrong_version_names_both_versions() {
        let mut b = bytes_of(Kind::Request, &sample());
        b[4..6].copy_from_slice(&9u16.to_le_bytes());
        let err = decode(&b, Expect::Request, 1024).unwrap_err();
        assert!(matches!(err, Error::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 9 }), "{err}");
        let text = err.to_string();
        assert!(text.contains("version 2") && text.contains("version 9"), "{text}");
    }

    #[test]
    fn bad_magic_kind_and_flags_are_refused() {
        let good = bytes_of(Kind::Request, &sample());
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(decode(&b, Expect::Request, 1024), Err(Error::BadMagic { .. })));
        let mut b = good.clone();
        b[6] = 0;
        assert!(matches!(decode(&b, Expect::Request, 1024), Err(Error::BadKind { got: 0, .. })));
        // A request where a reply is due is refused too.
        assert!(matches!(decode(&good, Expect::Reply, 1024), Err(Error::BadKind { got: 1, .. })));
        let mut b = good.clone();
        b[7] = 0x80;
        assert!(matches!(decode(&b, Expect::Request, 1024), Err(Error::BadFlags { got: 0x80 })));
        b[7] = 0x81;
        assert!(matches!(decode(&b, Expect::Request, 1024), Err(Error::BadFlags { got: 0x81 })));
        // FLAG_KEEP is a request's flag: a request may carry it, a reply not.
        b[7] = FLAG_KEEP;
        let (_, kept) = decode(&b, Expect::Request, 1024).unwrap();
        assert_eq!(kept, sample());
        let mut reply = bytes_of(Kind::Response, &sample());
        reply[7] = FLAG_KEEP;
        assert!(matches!(decode(&reply, Expect::Reply, 1024), Err(Error::BadFlags { got: 1 })));
    }

    #[test]
    fn the_keep_flag_round_trips_in_the_header() {
        let h = Header { kind: Kind::Request, method: 9, meta_len: 4, payload_len: 8, keep: true };
        assert_eq!(h.to_bytes()[7], FLAG_KEEP);
        assert_eq!(Header::parse(&h.to_bytes(), Expect::Request, 100).unwrap(), h);
    }

    #[test]
    fn a_huge_claim_fails_from_the_header_alone_without_allocating() {
        let h =
            Header { kind: Kind::Request, method: 1, meta_len: u32::MAX, payload_len: u64::MAX, keep: false };
        let mut d = Decoder::new(Expect::Request, DEFAULT_MAX_MESSAGE);
        // Only the 22 header bytes: the error comes before any body byte and
        // before the decoder owns any buffer.
        let err = d.feed(&h.to_bytes()).unwrap_err();
        assert!(matches!(err, Error::TooLarge { claimed: u64::MAX, max: DEFAULT_MAX_MESSAGE, .. }), "{err}");
        assert_eq!(d.meta.capacity(), 0);
        assert_eq!(d.payload.capacity(), 0);
        // One byte over the limit is refused; exactly the limit is accepted.
        let over = Header { kind: Kind::Request, method: 1, meta_len: 10, payload_len: 91, keep: false };
        assert!(matches!(Header::parse(&over.to_bytes(), Expect::Request, 100), Err(Error::TooLarge { .. })));
        let at = Header { kind: Kind::Request, method: 1, meta_len: 10, payload_len: 90, keep: true };
        assert_eq!(Header::parse(&at.to_bytes(), Expect::Request, 100).unwrap(), at);
    }

    #[test]
    fn payload_buffer_is_allocated_once_at_the_declared_size() {
        let frame = Frame { method: 3, meta: Bytes::new(), payload: Bytes::from(vec![5u8; 1000]) };
        let b = bytes_of(Kind::Response, &frame);
        let mut d = Decoder::new(Expect::Reply, 4096);
        for chunk in b.chunks(7) {
            d.feed(chunk).unwrap();
            if d.header().is_some() {
                assert_eq!(d.payload.capacity(), 1000, "no growth while feeding");
            }
        }
        assert!(d.is_complete());
        assert_eq!(d.finish().unwrap().1, frame);
    }

    #[test]
    fn a_large_claim_reserves_ahead_of_its_bytes_not_all_of_it() {
        // A header claiming 20 MiB of metadata and 40 MiB of payload: a
        // peer that sends the header alone gets RESERVE_AHEAD reserved for
        // each, not 60 MiB; as bytes arrive the buffers grow, never to more
        // than twice what came (or RESERVE_AHEAD), and the frame is whole.
        let meta: Vec<u8> = (0..20 << 20).map(|i: u32| (i % 251) as u8).collect();
        let payload: Vec<u8> = (0..40 << 20).map(|i: u32| (i % 241) as u8).collect();
        let frame = Frame { method: 9, meta: Bytes::from(meta), payload: Bytes::from(payload) };
        let b = bytes_of(Kind::Request, &frame);
        let pool = BufferPool::new(512 << 20);
        for mut d in
            [Decoder::new(Expect::Request, 64 << 20), Decoder::with_pool(Expect::Request, 64 << 20, pool)]
        {
            d.feed(&b[..HEADER_LEN]).unwrap();
            assert_eq!(d.meta.capacity(), RESERVE_AHEAD);
            assert_eq!(d.payload.capacity(), RESERVE_AHEAD);
            for chunk in b[HEADER_LEN..].chunks(1 << 20) {
                d.feed(chunk).unwrap();
                for (len, capacity) in
                    [(d.meta.len(), d.meta.capacity()), (d.payload.len(), d.payload.capacity())]
                {
                    assert!(capacity <= (2 * len).max(RESERVE_AHEAD), "{capacity} reserved for {len} bytes");
                }
            }
            assert_eq!(d.payload.capacity(), 40 << 20, "grown to the declared size, not past it");
            assert_eq!(d.finish().unwrap().1, frame);
        }
    }

    #[test]
    fn truncation_names_the_part() {
        let b = bytes_of(Kind::Request, &sample());
        let meta_len = sample().meta.len();
        let cases = [(10, "header"), (HEADER_LEN + 1, "metadata"), (HEADER_LEN + meta_len + 5, "payload")];
        for (cut, part) in cases {
            match decode(&b[..cut], Expect::Request, 1024) {
                Err(Error::Truncated { part: p, .. }) => assert_eq!(p, part),
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        assert!(matches!(decode(&[], Expect::Request, 1024), Err(Error::Truncated { got: 0, .. })));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut b = bytes_of(Kind::Request, &sample());
        b.extend_from_slice(b"xyz");
        assert!(matches!(decode(&b, Expect::Request, 1024), Err(Error::TrailingData { extra: 3 })));
    }

    /// A chunk size that differs from frame to frame.
    fn cuts_step(frame: &Frame) -> usize {
        frame.payload.len() % 13 + 1
    }

    proptest! {
        #[test]
        fn any_split_decodes_the_same(
            method: u16,
            meta in proptest::collection::vec(any::<u8>(), 0..50),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(0usize..400, 0..6),
        ) {
            let frame = Frame { method, meta: Bytes::from(meta), payload: Bytes::from(payload) };
            let b = bytes_of(Kind::Error, &frame);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(b.len())).collect();
            cuts.sort_unstable();
            let mut d = Decoder::new(Expect::Reply, 1024);
            let mut at = 0;
            for c in cuts.into_iter().chain([b.len()]) {
                d.feed(&b[at..c]).unwrap();
                at = c;
            }
            let (kind, back) = d.finish().unwrap();
            prop_assert_eq!(kind, Kind::Error);
            prop_assert_eq!(&back, &frame);
            let pool = BufferPool::new(1 << 20).pooling_from(0);
            let mut d = Decoder::with_pool(Expect::Reply, 1024, pool.clone());
            for chunk in b.chunks(cuts_step(&back)) {
                d.feed(chunk).unwrap();
            }
            prop_assert_eq!(d.finish().unwrap(), (Kind::Error, frame));
        }

        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200), max in 0u64..300) {
            // A pool that already holds buffers (with old bytes in them)
            // must decide exactly as a fresh buffer does.
            let pool = BufferPool::new(1 << 20).pooling_from(0);
            for len in [8usize, 64, 256] {
                let old = Frame { method: 0, meta: Bytes::new(), payload: Bytes::from(vec![0x11u8; len]) };
                drop(decode_pooled(&bytes_of(Kind::Request, &old), Expect::Request, 1 << 20, &pool));
            }
            prop_assert_eq!(pool.idle_buffers(), 3);
            for expect in [Expect::Request, Expect::Reply] {
                let plain = decode(&b, expect, max);
                let pooled = decode_pooled(&b, expect, max, &pool);
                match (&plain, &pooled) {
                    (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                    (Err(a), Err(b)) => prop_assert_eq!(a.to_string(), b.to_string()),
                    _ => prop_assert!(false, "plain {:?}, pooled {:?}", plain, pooled),
                }
            }
        }

        #[test]
        fn random_bodies_after_a_valid_header_never_panic(
            meta_len in 0u32..64, payload_len in 0u64..64, body in proptest::collection::vec(any::<u8>(), 0..200),
            keep in any::<bool>(),
        ) {
            let h = Header { kind: Kind::Request, method: 0, meta_len, payload_len, keep };
            let mut b = h.to_bytes().to_vec();
            b.extend_from_slice(&body);
            let result = decode(&b, Expect::Request, 1 << 20);
            let whole = u64::from(meta_len) + payload_len;
            match result {
                Ok((_, f)) => prop_assert_eq!(f.meta.len() as u64 + f.payload.len() as u64, whole),
                Err(Error::Truncated { .. }) => prop_assert!((body.len() as u64) < whole),
                Err(Error::TrailingData { .. }) => prop_assert!((body.len() as u64) > whole),
                Err(e) => prop_assert!(false, "unexpected {}", e),
            }
        }
    }
}
