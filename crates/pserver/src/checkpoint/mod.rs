//! Checkpoints of one pserver's [`ParamStore`]: atomic, checksummed files in
//! `<root>/ps-<index>/`, the newest verified one loaded on start.
//!
//! Two parts: the file format (`codec`: a writer into any `Write`, a
//! verifying reader from any `Read + Seek`) and the directory
//! ([`CheckpointDir`]: file names, atomic saves, pruning, and loading the
//! newest checkpoint that verifies, with fallback).
//!
//! **Saving** writes a [`StoreSnapshot`] (taken under the store's lock by
//! [`ParamStore::snapshot`], written with no lock held) block by block
//! through a buffered writer into a temp file of its own
//! (`ckpt-<step:020>.oarckpt.<process tag>-<n>.tmp`, created exclusively), fsyncs
//! it, renames it to `ckpt-<step:020>.oarckpt` and fsyncs the directory, so
//! a crash leaves either the old set of checkpoints or the new one, plus at
//! worst a `*.tmp` file that a save or load removes once it is
//! [`TMP_STALE`] (a newer one may be another writer's save in progress).
//! The service asks, just before the rename, whether the pserver still
//! owns the shard ([`CheckpointDir::save_checked`]). Memory used
//! beyond the store is the write buffer (1 MiB) and the blocks the store
//! copies because it updates them while the snapshot is written (see
//! [`StoreSnapshot`]).
//!
//! **Loading** tries the checkpoints newest first. Each file is read twice
//! through the same open handle: the first pass verifies everything (magic,
//! format version, every length against the file size before anything is
//! allocated, the CRC32, and that the file fits this store: server index,
//! placement fingerprint, optimizer name and state slots, every block's id
//! and length, and as many non-finite values as the header records: a
//! diverged store is saved and restored as it was, since refusing it
//! would lose every update acknowledged before the save) without touching
//! the store; only a file that
//! passed is read again and restored block by block, so a restore needs one
//! block of extra memory, not a second copy of the store. A file that fails
//! is skipped with a `warn!` line naming it and why, and the previous one is
//! tried.
//!
//! **File format, version 1.** All integers little-endian, floats raw IEEE
//! 754 little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `"OARCKPT\0"` |
//! | 4 | format version (`u32`, 1) |
//! | 4 | header length in bytes, from the magic up to the first block (`u32`) |
//! | 8 | placement fingerprint (`u64`) |
//! | 4 | server index (`u32`) |
//! | 8 | store step (`u64`) |
//! | 8 | save time, ms since the Unix epoch (`u64`) |
//! | 4 | optimizer state slots per element (`u32`) |
//! | 8 | number of blocks (`u64`) |
//! | 4 + n | optimizer name: length (`u32`) and UTF-8 bytes |
//! | 8 | pushes applied (`u64`, [`ParamStore::pushes`](crate::ParamStore::pushes)); a file without it reads as 0 |
//! | 8 | non-finite values the file holds (`u64`), only when there are some; a file without it holds none |
//! | | *(a later version may add header fields here; the header length skips them)* |
//! | per block | param (`u32`), block (`u32`), len (`u64`), optimizer step (`u64`), `len` parameters, `slots * len` state values |
//! | 8 | number of last-seq entries (`u64`), then per entry: trainer id length (`u32`), UTF-8 bytes, last seq (`u64`) |
//! | | *sparse tables, only in a model that has them:* table count (`u64`); per table: name length (`u32`) and UTF-8 bytes, dim (`u64`), counters admitted, evicted, expired, dropped candidates (`u64` each), row count (`u64`) and per row (id order) id (`u64`), optimizer step (`u64`), sightings (`u32`), last push's step (`u64`), `dim` values, `slots * dim` state values; candidate count (`u64`) and per candidate id (`u64`), sightings (`u32`), last step (`u64`) |
//! | | *origins applied, only if any ([`AppliedOrigins`](crate::AppliedOrigins), see [`origin`](crate::origin)); a table count of 0 comes first in a model without tables:* length (`u64`) and that many bytes of postcard |
//! | 4 | CRC32 (IEEE) of every byte before it |

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
#[cfg(doc)]
use crate::store::{ParamStore, StoreSnapshot};

mod codec;
mod dir;

pub use codec::{FORMAT_VERSION, MAGIC};
pub use dir::{load_file, CheckpointDir, EXTENSION, TMP_STALE};

/// What a save wrote or a load restored; the shell records it in
/// `ps/<index>/checkpoint` (see [`encode`](Self::encode)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// The checkpoint file.
    pub path: String,
    /// The store's step when it was saved.
    pub step: u64,
    /// The file's CRC32 (its last 4 bytes).
    pub checksum: u32,
    /// File size in bytes.
    pub bytes: u64,
    /// When it was saved, in ms since the Unix epoch.
    pub unix_time_ms: u64,
}

impl CheckpointInfo {
    /// Compact binary form (postcard), for a discovery value.
    pub fn encode(&self) -> Result<Vec<u8>> {
        postcard::to_allocvec(self).map_err(|e| Error::BadCheckpointRecord(e.to_string()))
    }

    /// Inverse of [`encode`](Self::encode); trailing bytes are an error.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        match postcard::take_from_bytes::<Self>(bytes) {
            Ok((info, [])) => Ok(info),
            Ok((_, rest)) => {
                Err(Error::BadCheckpointRecord(format!("{} unexpected bytes after the record", rest.len())))
            }
            Err(e) => Err(Error::BadCheckpointRecord(format!("{e} ({} bytes)", bytes.len()))),
        }
    }
}

impl fmt::Display for CheckpointInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {} in {} ({} bytes, crc32 {:08x}, saved at {} ms)",
            self.step, self.path, self.bytes, self.checksum, self.unix_time_ms
        )
    }
}

/// The result of [`CheckpointDir::load_latest`]: what was loaded, and the
/// newer files that were refused on the way, newest first, with why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedCheckpoint {
    /// The checkpoint now in the store.
    pub info: CheckpointInfo,
    /// Newer checkpoints that did not verify or did not fit, and why.
    pub skipped: Vec<(PathBuf, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::Adam;
    use crate::placement::Placement;
    use crate::spec::{Init, ParamSpec};
    use crate::store::{Mode, ParamStore, Push};
    use std::fs;
    use std::path::Path;

    fn store(seed: u64) -> ParamStore {
        let specs = vec![
            ParamSpec::new("w", vec![4, 3], Init::Uniform { low: -1.0, high: 1.0 }),
            ParamSpec::new("b", vec![3], Init::Zeros),
        ];
        let pl = Placement::new(&specs, 1, 5).unwrap();
        let opt = Adam { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8 };
        ParamStore::new(&pl, 0, seed, Box::new(opt), Mode::Async).unwrap()
    }

    fn trained() -> ParamStore {
        let mut st = store(1);
        let grads = st.blocks().map(|(id, p, _)| (id, vec![0.5; p.len()].into())).collect();
        st.push(Push {
            trainer: "t".into(),
            seq: 3,
            step: 0,
            weight: 1.0,
            grads,
            rows: Vec::new(),
            origin: None,
        })
        .unwrap();
        st
    }

    /// Saved bytes of `trained()` and the directory holding them.
    fn saved() -> (tempfile::TempDir, CheckpointDir, PathBuf, Vec<u8>) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path(), 0);
        let path = PathBuf::from(dir.save(&trained().snapshot().unwrap(), 2).unwrap().path);
        let bytes = fs::read(&path).unwrap();
        (tmp, dir, path, bytes)
    }

    /// Rewrite the trailing CRC so only the edit under test is wrong.
    fn with_crc(mut b: Vec<u8>) -> Vec<u8> {
        let n = b.len() - 4;
        let crc = crc32fast::hash(&b[..n]);
        b[n..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    fn load_err(path: &Path, bytes: Vec<u8>) -> Error {
        fs::write(path, bytes).unwrap();
        let mut st = store(2);
        let err = load_file(path, &mut st).unwrap_err();
        assert_eq!(st.step(), 0, "store untouched");
        err
    }

    #[test]
    fn layout_matches_the_documented_format() {
        let (_t, _d, _p, b) = saved();
        assert_eq!(&b[..8], &MAGIC);
        assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), FORMAT_VERSION);
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 72, "60 + \"adam\" + pushes");
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), trained().fingerprint());
        assert_eq!(u64::from_le_bytes(b[28..36].try_into().unwrap()), 1, "step");
        assert_eq!(u32::from_le_bytes(b[44..48].try_into().unwrap()), 2, "Adam slots");
        assert_eq!(u64::from_le_bytes(b[48..56].try_into().unwrap()), 4, "blocks 5+5+2+3");
        assert_eq!(&b[60..64], b"adam");
        assert_eq!(u64::from_le_bytes(b[64..72].try_into().unwrap()), 1, "pushes applied");
        // 72 header + 4 * 24 block heads + 15 * 3 floats + 8 + (4 + 1 + 8) seq + 4 CRC.
        assert_eq!(b.len(), 72 + 4 * 24 + 15 * 3 * 4 + 8 + 13 + 4);
        let n = b.len() - 4;
        assert_eq!(u32::from_le_bytes(b[n..].try_into().unwrap()), crc32fast::hash(&b[..n]));
    }

    #[test]
    fn version_error_names_both_versions() {
        let (_t, _d, path, mut b) = saved();
        b[8..12].copy_from_slice(&7u32.to_le_bytes());
        let err = load_err(&path, with_crc(b)).to_string();
        assert!(err.contains("format version 7") && err.contains("reads version 1"), "{err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
    }

    #[test]
    fn lengths_are_checked_against_the_file_before_allocating() {
        let (_t, _d, path, good) = saved();
        let n = good.len();
        // Last-seq count claiming 2^62 entries.
        let mut b = good.clone();
        let seq_count = n - 4 - 13 - 8;
        b[seq_count..seq_count + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let err = load_err(&path, with_crc(b)).to_string();
        assert!(err.contains("last-seq entries") && err.contains("remain"), "{err}");
        // A trainer id of 4 GiB.
        let mut b = good.clone();
        b[seq_count + 8..seq_count + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = load_err(&path, with_crc(b)).to_string();
        assert!(err.contains("trainer id") && err.contains("4294967295 bytes"), "{err}");
        // A header that claims to be 4 GiB long.
        let mut b = good.clone();
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = load_err(&path, with_crc(b)).to_string();
        assert!(err.contains("header extension"), "{err}");
        // An optimizer name longer than the header.
        let mut b = good.clone();
        b[56..60].copy_from_slice(&13u32.to_le_bytes());
        let err = load_err(&path, with_crc(b)).to_string();
        assert!(err.contains("does not fit in the 72-byte header"), "{err}");
        // A block count of 2^60 is a mismatch with the store, reported as such
        // once the CRC checked out.
        let mut b = good.clone();
        b[48..56].copy_from_slice(&(1u64 << 60).to_le_bytes());
        let err = load_err(&path, with_crc(b));
        assert!(
            matches!(&err, Error::CheckpointMismatch { reason, .. } if reason.contains("1152921504606846976 blocks")),
            "{err}"
        );
        // A block length of 2^40 likewise, without reading 4 TiB.
        let mut b = good;
        b[72 + 8..72 + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let err = load_err(&path, with_crc(b));
        assert!(
            matches!(&err, Error::CheckpointMismatch { reason, .. } if reason.contains("1099511627776 values")),
            "{err}"
        );
    }

    #[test]
    fn non_finite_values_are_refused_even_with_a_good_crc() {
        let (_t, _d, path, mut b) = saved();
        // Second parameter of block 0.0.
        b[72 + 24 + 4..72 + 24 + 8].copy_from_slice(&f32::NAN.to_le_bytes());
        let err = load_err(&path, with_crc(b));
        assert!(
            matches!(&err, Error::CorruptCheckpoint { reason, .. } if reason.contains("block 0.0 parameters") && reason.contains("index 1")),
            "{err}"
        );
    }

    #[test]
    fn a_bad_block_after_good_ones_leaves_the_store_untouched() {
        let (_t, _d, path, mut b) = saved();
        let last_block_slot = b.len() - 4 - 13 - 8 - 4;
        b[last_block_slot..last_block_slot + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        fs::write(&path, with_crc(b)).unwrap();
        let mut st = store(2);
        let before: Vec<Vec<f32>> = st.blocks().map(|(_, p, _)| p.to_vec()).collect();
        let err = load_file(&path, &mut st).unwrap_err().to_string();
        assert!(err.contains("block 1.0 optimizer slots") && err.contains("inf"), "{err}");
        let after: Vec<Vec<f32>> = st.blocks().map(|(_, p, _)| p.to_vec()).collect();
        assert_eq!(before, after);
        assert!(st.blocks().all(|(_, _, s)| s.step == 0));
    }

    #[test]
    fn io_errors_name_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        // The "root" is a file, so the directory cannot be created.
        let root = tmp.path().join("plain-file");
        fs::write(&root, b"x").unwrap();
        let err = CheckpointDir::new(&root, 0).save(&trained().snapshot().unwrap(), 2).unwrap_err();
        assert!(matches!(err, Error::CheckpointIo { action: "creating directory", .. }), "{err}");
        assert!(err.to_string().contains("plain-file"), "{err}");
        let missing = tmp.path().join("nope.oarckpt");
        let err = load_file(&missing, &mut store(1)).unwrap_err().to_string();
        assert!(err.contains("nope.oarckpt") && err.contains("opening"), "{err}");
    }
}
