use crate::{Error, Result};
use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};

/// One message: a method number, encoded control metadata and a raw payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    /// Which operation of the service this is (services define their own numbers).
    pub method: u16,
    /// Control metadata, postcard-encoded.
    pub meta: Bytes,
    /// Tensor data, little-endian `f32`, untouched by the transport.
    pub payload: Bytes,
}

impl Frame {
    /// A frame whose metadata is `meta` encoded with postcard.
    pub fn new<T: Serialize + ?Sized>(method: u16, meta: &T, payload: Bytes) -> Result<Frame> {
        let meta = postcard::to_allocvec(meta).map_err(|e| Error::Codec {
            action: "encode",
            what: std::any::type_name::<T>(),
            reason: e.to_string(),
        })?;
        Ok(Frame { method, meta: Bytes::from(meta), payload })
    }

    /// Decode the metadata as `T`.
    pub fn meta<T: DeserializeOwned>(&self) -> Result<T> {
        postcard::from_bytes(&self.meta).map_err(|e| Error::Codec {
            action: "decode",
            what: std::any::type_name::<T>(),
            reason: e.to_string(),
        })
    }

    /// The payload as a vector of `f32` (one bulk copy).
    pub fn payload_f32(&self) -> Result<Vec<f32>> {
        bytes_to_f32s(&self.payload)
    }
}

/// A frame to send whose payload is in several buffers, sent one after
/// another as one payload: a reply made of views of data the handler
/// holds elsewhere (e.g. shared parameter blocks) goes out without being
/// joined into one buffer first. The receiver sees an ordinary [`Frame`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameParts {
    /// Which operation of the service this is.
    pub method: u16,
    /// Control metadata, postcard-encoded.
    pub meta: Bytes,
    /// The payload, in order.
    pub payload: Vec<Bytes>,
}

impl FrameParts {
    /// The payload's length in bytes.
    pub fn payload_len(&self) -> u64 {
        self.payload.iter().map(|p| p.len() as u64).sum()
    }

    /// One [`Frame`] with the payload joined (one copy, unless it is in one
    /// part or none): for a transport that hands over whole frames in memory.
    pub fn join(self) -> Frame {
        let FrameParts { method, meta, mut payload } = self;
        let payload = match payload.len() {
            0 => Bytes::new(),
            1 => payload.swap_remove(0),
            _ => Bytes::from(payload.concat()),
        };
        Frame { method, meta, payload }
    }
}

impl From<Frame> for FrameParts {
    fn from(frame: Frame) -> FrameParts {
        let Frame { method, meta, payload } = frame;
        let payload = if payload.is_empty() { Vec::new() } else { vec![payload] };
        FrameParts { method, meta, payload }
    }
}

/// The little-endian bytes of the `f32`s `owner` holds, as [`Bytes`] that
/// keep `owner` alive: no copy on a little-endian machine (one elsewhere).
/// For a payload part that is a view of values held elsewhere, e.g. an
/// `Arc` shared with a store.
pub fn f32s_shared<T: AsRef<[f32]> + Send + 'static>(owner: T) -> Bytes {
    if cfg!(target_endian = "little") {
        Bytes::from_owner(F32Bytes(owner))
    } else {
        f32s_to_bytes(owner.as_ref())
    }
}

/// An owner of `f32`s seen as their bytes (little-endian machines only).
struct F32Bytes<T>(T);

impl<T: AsRef<[f32]>> AsRef<[u8]> for F32Bytes<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(self.0.as_ref())
    }
}

/// Little-endian bytes of `values`, in one bulk copy.
pub fn f32s_to_bytes(values: &[f32]) -> Bytes {
    Bytes::copy_from_slice(&f32s_as_le_bytes(values))
}

/// Append the little-endian bytes of `values` to `buf` (one bulk copy):
/// how a payload of several blocks is assembled.
pub fn put_f32s(buf: &mut bytes::BytesMut, values: &[f32]) {
    buf.extend_from_slice(&f32s_as_le_bytes(values));
}

/// `src` read in place as little-endian `f32`, when it can be: on a
/// little-endian machine, with `src` 4-byte aligned and a multiple of 4
/// bytes long. `None` otherwise; decode with [`copy_f32s_from_bytes`] then.
pub fn f32s_view(src: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "little") {
        bytemuck::try_cast_slice(src).ok()
    } else {
        None
    }
}

/// Copy little-endian `f32` from `src` into `dst`, which must be exactly as long.
pub fn copy_f32s_from_bytes(dst: &mut [f32], src: &[u8]) -> Result<()> {
    if src.len() != dst.len() * 4 {
        return Err(Error::PayloadLength { expected: dst.len() * 4, got: src.len() });
    }
    #[cfg(target_endian = "little")]
    bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src);
    #[cfg(not(target_endian = "little"))]
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
    Ok(())
}

/// `src` as a vector of `f32`; its length must be a multiple of 4.
pub fn bytes_to_f32s(src: &[u8]) -> Result<Vec<f32>> {
    if src.len() % 4 != 0 {
        return Err(Error::PayloadLength { expected: src.len() / 4 * 4, got: src.len() });
    }
    let mut out = vec![0f32; src.len() / 4];
    copy_f32s_from_bytes(&mut out, src)?;
    Ok(out)
}

/// The little-endian bytes of `values`: borrowed as they are on
/// little-endian machines (no copy), converted elsewhere.
pub fn f32s_as_le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    return std::borrow::Cow::Borrowed(bytemuck::cast_slice(values));
    #[cfg(not(target_endian = "little"))]
    return std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn payload_is_little_endian() {
        let b = f32s_to_bytes(&[1.0]);
        assert_eq!(b.as_ref(), &1.0f32.to_le_bytes());
    }

    #[test]
    fn wrong_payload_length_is_an_error_that_says_both_lengths() {
        let mut dst = [0f32; 2];
        let err = copy_f32s_from_bytes(&mut dst, &[0u8; 7]).unwrap_err();
        assert_eq!(err.to_string(), "payload of 7 bytes, expected 8");
        assert!(bytes_to_f32s(&[0u8; 5]).is_err());
    }

    #[test]
    fn frame_parts_join_in_order_and_a_frame_is_one_part() {
        let parts = FrameParts {
            method: 4,
            meta: Bytes::from_static(b"m"),
            payload: vec![Bytes::from_static(b"ab"), Bytes::new(), Bytes::from_static(b"c")],
        };
        assert_eq!(parts.payload_len(), 3);
        let frame = parts.join();
        assert_eq!((frame.method, &frame.meta[..], &frame.payload[..]), (4, &b"m"[..], &b"abc"[..]));
        let one = Bytes::from_static(b"xyz");
        let back = FrameParts::from(Frame { method: 1, meta: Bytes::new(), payload: one.clone() });
        assert_eq!(back.payload, vec![one.clone()]);
        // One part is handed back as it is, not copied.
        assert_eq!(back.join().payload.as_ptr(), one.as_ptr());
        assert!(FrameParts::from(Frame::default()).payload.is_empty());
    }

    #[test]
    fn shared_f32s_are_their_little_endian_bytes_and_keep_their_owner() {
        let values: std::sync::Arc<[f32]> = vec![1.0f32, -2.5, 3.25].into();
        let bytes = f32s_shared(values.clone());
        assert_eq!(bytes, f32s_to_bytes(&values));
        assert_eq!(std::sync::Arc::strong_count(&values), 2, "the bytes hold the owner");
        if cfg!(target_endian = "little") {
            assert_eq!(bytes.as_ptr(), values.as_ptr().cast::<u8>(), "a view, not a copy");
        }
        drop(bytes);
        assert_eq!(std::sync::Arc::strong_count(&values), 1);
    }

    #[test]
    fn garbage_metadata_is_a_decode_error() {
        let frame = Frame { method: 1, meta: Bytes::from_static(&[0xff, 0xff, 0xff]), payload: Bytes::new() };
        let err = frame.meta::<(u64, String)>().unwrap_err();
        assert!(err.to_string().starts_with("cannot decode"), "{err}");
    }

    proptest! {
        #[test]
        fn f32_round_trip(values in proptest::collection::vec(any::<f32>(), 0..300)) {
            let back = bytes_to_f32s(&f32s_to_bytes(&values)).unwrap();
            prop_assert_eq!(back.len(), values.len());
            for (a, b) in back.iter().zip(&values) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
        }

        #[test]
        fn meta_round_trip(method: u16, n: u64, s in ".{0,40}") {
            let frame = Frame::new(method, &(n, s.clone()), Bytes::new()).unwrap();
            prop_assert_eq!(frame.meta::<(u64, String)>().unwrap(), (n, s));
        }
    }
}
