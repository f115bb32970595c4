//! Feeds arbitrary bytes to the frame decoder, whole and in chunks, and in
//! chunks into buffers from a pool that keeps the earlier inputs' buffers
//! (with their bytes): it must never panic, all three must agree, and what
//! it accepts must re-encode to exactly the input and respect the maximum
//! size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use oar_transport::wire::{self, BufferPool, Decoder, Expect};
use std::sync::LazyLock;

/// Shared by every input, so that buffers are reused across them; every
/// payload size goes through it.
static POOL: LazyLock<BufferPool> = LazyLock::new(|| BufferPool::new(1 << 20).pooling_from(0));

const MAXES: [u64; 5] = [0, 16, 1024, 1 << 20, wire::DEFAULT_MAX_MESSAGE];

fuzz_target!(|data: &[u8]| {
    let Some((&control, input)) = data.split_first() else { return };
    let expect = if control & 1 == 0 { Expect::Request } else { Expect::Reply };
    let max = MAXES[(control as usize >> 1) % MAXES.len()];
    let step = usize::from(control >> 4) + 1;

    let whole = wire::decode(input, expect, max);

    let mut decoder = Decoder::new(expect, max);
    let mut fed = Ok(());
    for chunk in input.chunks(step) {
        fed = decoder.feed(chunk);
        if fed.is_err() {
            break;
        }
    }
    let chunked = fed.and_then(|()| decoder.finish());

    let mut decoder = Decoder::with_pool(expect, max, POOL.clone());
    let mut fed = Ok(());
    for chunk in input.chunks(step) {
        fed = decoder.feed(chunk);
        if fed.is_err() {
            break;
        }
    }
    let pooled = fed.and_then(|()| decoder.finish());

    for other in [&chunked, &pooled] {
        match (&whole, other) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (Err(a), Err(b)) => {
                assert_eq!(std::mem::discriminant(a), std::mem::discriminant(b), "{a} vs {b}")
            }
            _ => panic!("whole input gave {whole:?}, chunks gave {other:?}"),
        }
    }
    if let Ok((kind, frame)) = whole {
        assert!(frame.meta.len() as u64 + frame.payload.len() as u64 <= max);
        let again = wire::encode(kind, &frame).expect("an accepted frame re-encodes").concat();
        assert_eq!(again, input);
    }
});
