//! Checkpoints of one pserver's [`ParamStore`]: atomic, checksummed files in
//! `<root>/ps-<index>/`, the newest verified one loaded on start.
//!
//! **Saving** streams the store block by block through a buffered writer
//! into `ckpt-<step:020>.oarckpt.tmp`, fsyncs it, renames it to
//! `ckpt-<step:020>.oarckpt` and fsyncs the directory, so a crash leaves
//! either the old set of checkpoints or the new one, plus at worst a `*.tmp`
//! file that the next save or load removes. Memory used beyond the store is
//! the write buffer (1 MiB), whatever the store's size.
//!
//! **Loading** tries the checkpoints newest first. Each file is read twice
//! through the same open handle: the first pass verifies everything (magic,
//! format version, every length against the file size before anything is
//! allocated, the CRC32, and that the file fits this store: server index,
//! placement fingerprint, optimizer name and state slots, every block's id
//! and length, finite values) without touching the store; only a file that
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
//! | | *(a later version may add header fields here; the header length skips them)* |
//! | per block | param (`u32`), block (`u32`), len (`u64`), optimizer step (`u64`), `len` parameters, `slots * len` state values |
//! | 8 | number of last-seq entries (`u64`), then per entry: trainer id length (`u32`), UTF-8 bytes, last seq (`u64`) |
//! | 4 | CRC32 (IEEE) of every byte before it |

use std::fmt;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::optimizer::OptimizerState;
use crate::store::ParamStore;

/// The first 8 bytes of every checkpoint file.
pub const MAGIC: [u8; 8] = *b"OARCKPT\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Checkpoint file extension.
pub const EXTENSION: &str = "oarckpt";

const PREFIX: &str = "ckpt-";
const TMP_SUFFIX: &str = ".tmp";
/// Header bytes before the optimizer name.
const FIXED_HEADER: u64 = 60;
/// param + block + len + optimizer step.
const BLOCK_HEAD: u64 = 24;
/// trainer id length + seq: the smallest last-seq entry.
const SEQ_ENTRY_MIN: u64 = 12;
const TRAILER: u64 = 4;
const IO_BUF: usize = 1 << 20;

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

/// Where one pserver keeps its checkpoints: `<root>/ps-<index>/ckpt-<step:020>.oarckpt`.
///
/// "Newest" means the highest step in the file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointDir {
    index: u32,
    dir: PathBuf,
}

impl CheckpointDir {
    /// The checkpoint directory of pserver `index` under `root`. Nothing is
    /// created until the first save.
    pub fn new(root: impl Into<PathBuf>, index: u32) -> Self {
        Self { index, dir: root.into().join(format!("ps-{index}")) }
    }

    /// `<root>/ps-<index>`.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The pserver index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The file a checkpoint of `step` is saved to.
    pub fn file_for_step(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{PREFIX}{step:020}.{EXTENSION}"))
    }

    /// Write `store` atomically (temp file, fsync, rename, fsync of the
    /// directory), then prune: keep the new checkpoint and the `keep - 1`
    /// newest ones older than it, delete older ones (files with a higher step
    /// than the new one, left by a run that restarted from an older
    /// checkpoint, are left alone). `keep` must be at least 2 so a corrupt
    /// newest file always has a fallback. A failed prune is logged, not
    /// returned: the new checkpoint is safe either way.
    pub fn save(&self, store: &ParamStore, keep: usize) -> Result<CheckpointInfo> {
        if keep < 2 {
            return Err(Error::Config(format!(
                "checkpoints to keep must be at least 2 (so a corrupt newest one has a fallback), got {keep}"
            )));
        }
        self.check_server(store)?;
        if store.step_underway() {
            return Err(Error::CheckpointStepUnderway { step: store.step() });
        }
        let header = HeaderOut::of(store)?;
        let created = !self.dir.exists();
        fs::create_dir_all(&self.dir).map_err(io_err("creating directory", &self.dir))?;
        if created {
            if let Some(parent) = self.dir.parent() {
                sync_dir(parent)?;
            }
        }
        self.remove_tmp_files();

        let step = store.step();
        let path = self.file_for_step(step);
        let tmp = self.dir.join(format!("{PREFIX}{step:020}.{EXTENSION}{TMP_SUFFIX}"));
        let unix_time_ms = now_ms();
        let written = write_file(&tmp, store, &header, unix_time_ms).and_then(|v| {
            fs::rename(&tmp, &path).map_err(io_err("renaming the temp file to", &path)).map(|()| v)
        });
        let (checksum, bytes) = match written {
            Ok(v) => v,
            Err(e) => {
                // Best effort: the next save or load removes it anyway.
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        sync_dir(&self.dir)?;
        let info = CheckpointInfo { path: path.display().to_string(), step, checksum, bytes, unix_time_ms };
        tracing::debug!("saved checkpoint: {info}");
        self.prune(step, keep);
        Ok(info)
    }

    /// Load the newest checkpoint that verifies and fits into `store` (see
    /// the module docs for what is checked). Newer ones that fail are
    /// skipped with a `warn!` line each and listed in the result. Leftover
    /// `*.tmp` files of interrupted saves are ignored and removed.
    ///
    /// `Ok(None)` when there is no checkpoint at all;
    /// [`Error::NoValidCheckpoint`] naming every file and why when there are
    /// some but none loads. A refused file never changes the store (unless it
    /// is rewritten in place between its verification and its restore, which
    /// the error then says; a successful fallback still restores everything).
    pub fn load_latest(&self, store: &mut ParamStore) -> Result<Option<LoadedCheckpoint>> {
        self.check_server(store)?;
        let files = self.list()?;
        self.remove_tmp_files();
        if files.is_empty() {
            return Ok(None);
        }
        let mut skipped = Vec::new();
        for path in files {
            match load_path(&path, store) {
                Ok(info) => {
                    tracing::info!("loaded checkpoint: {info}");
                    return Ok(Some(LoadedCheckpoint { info, skipped }));
                }
                Err(reject) => {
                    let why = reject.reason();
                    tracing::warn!("skipping checkpoint {}: {why}", path.display());
                    skipped.push((path, why));
                }
            }
        }
        Err(Error::NoValidCheckpoint { dir: self.dir.clone(), tried: skipped })
    }

    /// The checkpoint files, newest (highest step) first. Temp files and
    /// other names are ignored; a missing directory is an empty list.
    pub fn list(&self) -> Result<Vec<PathBuf>> {
        Ok(self.list_steps()?.into_iter().map(|(_, p)| p).collect())
    }

    fn list_steps(&self) -> Result<Vec<(u64, PathBuf)>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("listing", &self.dir)(e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("listing", &self.dir))?;
            let name = entry.file_name();
            let Some(step) = name.to_str().and_then(step_of_name) else {
                continue;
            };
            if entry.file_type().is_ok_and(|t| !t.is_dir()) {
                out.push((step, entry.path()));
            }
        }
        out.sort_unstable_by(|a, b| b.cmp(a));
        Ok(out)
    }

    fn check_server(&self, store: &ParamStore) -> Result<()> {
        if store.server() == self.index {
            Ok(())
        } else {
            Err(Error::Config(format!(
                "checkpoint directory {} is for pserver {}, but the store is server {}",
                self.dir.display(),
                self.index,
                store.server()
            )))
        }
    }

    /// Remove `ckpt-*.tmp` files left by interrupted saves (best effort).
    fn remove_tmp_files(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            if name.starts_with(PREFIX) && name.ends_with(TMP_SUFFIX) {
                let path = entry.path();
                match fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::info!("removed {} left by an interrupted checkpoint save", path.display())
                    }
                    Err(e) => tracing::warn!("cannot remove leftover temp file {}: {e}", path.display()),
                }
            }
        }
    }

    /// Delete checkpoints older than `written`, keeping the `keep - 1` newest of them.
    fn prune(&self, written: u64, keep: usize) {
        let files = match self.list_steps() {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("cannot prune old checkpoints: {e}");
                return;
            }
        };
        for (_, path) in files.into_iter().filter(|(s, _)| *s < written).skip(keep - 1) {
            match fs::remove_file(&path) {
                Ok(()) => tracing::debug!("pruned old checkpoint {}", path.display()),
                Err(e) => tracing::warn!("cannot prune old checkpoint {}: {e}", path.display()),
            }
        }
    }
}

/// Verify the checkpoint at `path` and load it into `store` (one file, no
/// fallback). Errors: [`Error::CheckpointIo`], [`Error::CorruptCheckpoint`],
/// [`Error::CheckpointMismatch`]; the store is unchanged by a refused file.
pub fn load_file(path: &Path, store: &mut ParamStore) -> Result<CheckpointInfo> {
    load_path(path, store).map_err(|r| r.into_error(path))
}

/// `ckpt-<digits>.oarckpt` -> the step.
fn step_of_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(EXTENSION)?.strip_suffix('.')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::CheckpointIo { action, path: path.to_path_buf(), source }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("syncing directory", dir))
}

// ---------------------------------------------------------------- writing

/// The header fields that need converting, checked before the file is created.
struct HeaderOut {
    name: String,
    name_len: u32,
    header_len: u32,
    slots: u32,
    blocks: u64,
}

impl HeaderOut {
    fn of(store: &ParamStore) -> Result<Self> {
        let opt = store.optimizer();
        let name = opt.name().to_string();
        let too_big = |what: String| Error::Config(format!("cannot checkpoint: {what}"));
        let name_len = u32::try_from(name.len())
            .map_err(|_| too_big(format!("optimizer name of {} bytes is too long", name.len())))?;
        let header_len = u32::try_from(FIXED_HEADER + u64::from(name_len))
            .map_err(|_| too_big(format!("optimizer name of {} bytes is too long", name.len())))?;
        let slots = u32::try_from(opt.state_slots())
            .map_err(|_| too_big(format!("{} optimizer state slots", opt.state_slots())))?;
        Ok(Self { name, name_len, header_len, slots, blocks: store.block_ids().count() as u64 })
    }
}

/// A writer that hashes and counts what goes through it.
struct CrcWriter<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    bytes: u64,
}

impl<W: Write> CrcWriter<W> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.inner.write_all(b)?;
        self.hasher.update(b);
        self.bytes += b.len() as u64;
        Ok(())
    }

    fn u32(&mut self, v: u32) -> io::Result<()> {
        self.put(&v.to_le_bytes())
    }

    fn u64(&mut self, v: u64) -> io::Result<()> {
        self.put(&v.to_le_bytes())
    }

    fn f32s(&mut self, v: &[f32]) -> io::Result<()> {
        if cfg!(target_endian = "little") {
            self.put(bytemuck::cast_slice(v))
        } else {
            let mut buf = Vec::with_capacity(4096);
            for chunk in v.chunks(1024) {
                buf.clear();
                for x in chunk {
                    buf.extend_from_slice(&x.to_le_bytes());
                }
                self.put(&buf)?;
            }
            Ok(())
        }
    }
}

/// Write the whole checkpoint to `tmp` and fsync it; returns (CRC, size).
fn write_file(tmp: &Path, store: &ParamStore, h: &HeaderOut, unix_time_ms: u64) -> Result<(u32, u64)> {
    let file = File::create(tmp).map_err(io_err("creating", tmp))?;
    let mut w = CrcWriter {
        inner: BufWriter::with_capacity(IO_BUF, file),
        hasher: crc32fast::Hasher::new(),
        bytes: 0,
    };
    write_body(&mut w, store, h, unix_time_ms).map_err(io_err("writing", tmp))?;
    let checksum = w.hasher.clone().finalize();
    w.inner.write_all(&checksum.to_le_bytes()).map_err(io_err("writing", tmp))?;
    let file = w.inner.into_inner().map_err(|e| io_err("writing", tmp)(e.into_error()))?;
    file.sync_all().map_err(io_err("syncing", tmp))?;
    Ok((checksum, w.bytes + TRAILER))
}

fn write_body<W: Write>(
    w: &mut CrcWriter<W>,
    store: &ParamStore,
    h: &HeaderOut,
    unix_time_ms: u64,
) -> io::Result<()> {
    w.put(&MAGIC)?;
    w.u32(FORMAT_VERSION)?;
    w.u32(h.header_len)?;
    w.u64(store.fingerprint())?;
    w.u32(store.server())?;
    w.u64(store.step())?;
    w.u64(unix_time_ms)?;
    w.u32(h.slots)?;
    w.u64(h.blocks)?;
    w.u32(h.name_len)?;
    w.put(h.name.as_bytes())?;
    for (id, params, state) in store.blocks() {
        w.u32(id.param)?;
        w.u32(id.block)?;
        w.u64(params.len() as u64)?;
        w.u64(state.step)?;
        w.f32s(params)?;
        w.f32s(&state.slots)?;
    }
    // Sorted, so the same store always gives the same bytes.
    let mut seqs: Vec<(&str, u64)> = store.last_seqs().collect();
    seqs.sort_unstable();
    w.u64(seqs.len() as u64)?;
    for (trainer, seq) in seqs {
        let len = u32::try_from(trainer.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "trainer id longer than 4 GiB"))?;
        w.u32(len)?;
        w.put(trainer.as_bytes())?;
        w.u64(seq)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- reading

/// Why a file was refused.
#[derive(Debug)]
enum Reject {
    Io(&'static str, io::Error),
    Corrupt(String),
    Mismatch(String),
}

impl Reject {
    fn reason(&self) -> String {
        match self {
            Reject::Io(action, e) => format!("I/O error {action}: {e}"),
            Reject::Corrupt(r) => format!("corrupt: {r}"),
            Reject::Mismatch(r) => format!("does not fit this pserver: {r}"),
        }
    }

    fn into_error(self, path: &Path) -> Error {
        let path = path.to_path_buf();
        match self {
            Reject::Io(action, source) => Error::CheckpointIo { action, path, source },
            Reject::Corrupt(reason) => Error::CorruptCheckpoint { path, reason },
            Reject::Mismatch(reason) => Error::CheckpointMismatch { path, reason },
        }
    }
}

type Check<T> = std::result::Result<T, Reject>;

/// What the store expects of a checkpoint.
struct Expect {
    server: u32,
    fingerprint: u64,
    optimizer: String,
    slots: u64,
    blocks: Vec<(BlockId, usize)>,
}

impl Expect {
    fn of(store: &ParamStore) -> Self {
        Self {
            server: store.server(),
            fingerprint: store.fingerprint(),
            optimizer: store.optimizer().name().to_string(),
            slots: store.optimizer().state_slots() as u64,
            blocks: store.blocks().map(|(id, p, _)| (id, p.len())).collect(),
        }
    }
}

struct Header {
    fingerprint: u64,
    server: u32,
    step: u64,
    unix_time_ms: u64,
    slots: u64,
    blocks: u64,
    optimizer: String,
}

impl Header {
    /// Why the file does not fit the store, if it does not.
    fn mismatch(&self, e: &Expect) -> Option<String> {
        if self.server != e.server {
            return Some(format!("written by server {}, this store is server {}", self.server, e.server));
        }
        if self.fingerprint != e.fingerprint {
            return Some(format!(
                "placement fingerprint {:016x} in the file, {:016x} for this store (another model, server count or block size)",
                self.fingerprint, e.fingerprint
            ));
        }
        if self.optimizer != e.optimizer {
            return Some(format!(
                "optimizer {:?} in the file, this store uses {:?}",
                self.optimizer, e.optimizer
            ));
        }
        if self.slots != e.slots {
            return Some(format!(
                "{} optimizer state slots per element in the file, optimizer {:?} has {}",
                self.slots, e.optimizer, e.slots
            ));
        }
        if self.blocks != e.blocks.len() as u64 {
            return Some(format!("{} blocks in the file, this store holds {}", self.blocks, e.blocks.len()));
        }
        None
    }
}

/// What a whole scan of a file found.
struct Scanned {
    header: Header,
    seqs: Vec<(String, u64)>,
    checksum: u32,
    bytes: u64,
}

/// A reader over the checksummed part of a file (everything but the
/// trailer) that never reads or allocates past it.
struct Body<R> {
    inner: R,
    hasher: crc32fast::Hasher,
    pos: u64,
    end: u64,
}

impl<R: Read> Body<R> {
    fn remaining(&self) -> u64 {
        self.end.saturating_sub(self.pos)
    }

    fn need(&self, n: u64, what: &str) -> Check<()> {
        if n > self.remaining() {
            Err(Reject::Corrupt(format!(
                "{what} at byte {} needs {n} bytes, but only {} remain before the checksum (truncated, or a corrupt length)",
                self.pos,
                self.remaining()
            )))
        } else {
            Ok(())
        }
    }

    fn fill(&mut self, buf: &mut [u8]) -> Check<()> {
        match self.inner.read_exact(buf) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(Reject::Corrupt(format!("the file ends early, near byte {}", self.pos)))
            }
            Err(e) => return Err(Reject::Io("reading", e)),
        }
        self.hasher.update(buf);
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Check<[u8; N]> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Check<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Check<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, len: u64, what: &str) -> Check<String> {
        self.need(len, what)?;
        let mut b = vec![0u8; to_usize(len, what)?];
        self.fill(&mut b)?;
        String::from_utf8(b).map_err(|e| Reject::Corrupt(format!("{what} is not UTF-8: {e}")))
    }

    /// `n` floats; the length is checked against the file before allocating.
    fn f32s(&mut self, n: u64, what: &str) -> Check<Vec<f32>> {
        let bytes =
            n.checked_mul(4).ok_or_else(|| Reject::Corrupt(format!("{what}: {n} values overflow")))?;
        self.need(bytes, what)?;
        let mut v = vec![0f32; to_usize(n, what)?];
        self.fill(bytemuck::cast_slice_mut(&mut v))?;
        if cfg!(target_endian = "big") {
            for x in &mut v {
                *x = f32::from_bits(u32::from_le(x.to_bits()));
            }
        }
        Ok(v)
    }

    fn skip(&mut self, mut n: u64, what: &str) -> Check<()> {
        self.need(n, what)?;
        let mut buf = [0u8; 8192];
        while n > 0 {
            let k = n.min(buf.len() as u64) as usize;
            self.fill(&mut buf[..k])?;
            n -= k as u64;
        }
        Ok(())
    }

    /// Everything read; compare the trailer with the CRC of what was read.
    fn finish(&mut self) -> Check<u32> {
        if self.pos != self.end {
            return Err(Reject::Corrupt(format!(
                "{} unexpected bytes between the last section (ends at byte {}) and the checksum",
                self.remaining(),
                self.pos
            )));
        }
        let mut t = [0u8; 4];
        match self.inner.read_exact(&mut t) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(Reject::Corrupt("the file ends before its checksum".into()))
            }
            Err(e) => return Err(Reject::Io("reading", e)),
        }
        let stored = u32::from_le_bytes(t);
        let computed = self.hasher.clone().finalize();
        if stored != computed {
            return Err(Reject::Corrupt(format!(
                "checksum mismatch: the file records crc32 {stored:08x}, its contents hash to {computed:08x}"
            )));
        }
        Ok(stored)
    }
}

fn to_usize(n: u64, what: &str) -> Check<usize> {
    usize::try_from(n).map_err(|_| Reject::Corrupt(format!("{what}: {n} does not fit in memory")))
}

fn read_header<R: Read>(r: &mut Body<R>) -> Check<Header> {
    let magic: [u8; 8] = r.array("magic")?;
    if magic != MAGIC {
        return Err(Reject::Corrupt(format!(
            "bad magic \"{}\", expected \"{}\": not an oar checkpoint",
            magic.escape_ascii(),
            MAGIC.escape_ascii()
        )));
    }
    let version = r.u32("format version")?;
    if version != FORMAT_VERSION {
        return Err(Reject::Corrupt(format!(
            "format version {version}, but this build reads version {FORMAT_VERSION}"
        )));
    }
    let header_len = u64::from(r.u32("header length")?);
    if header_len < FIXED_HEADER {
        return Err(Reject::Corrupt(format!(
            "header length {header_len} is below the minimum {FIXED_HEADER}"
        )));
    }
    let fingerprint = r.u64("placement fingerprint")?;
    let server = r.u32("server index")?;
    let step = r.u64("step")?;
    let unix_time_ms = r.u64("save time")?;
    let slots = u64::from(r.u32("optimizer slots")?);
    let blocks = r.u64("block count")?;
    let name_len = u64::from(r.u32("optimizer name length")?);
    if FIXED_HEADER + name_len > header_len {
        return Err(Reject::Corrupt(format!(
            "optimizer name of {name_len} bytes does not fit in the {header_len}-byte header"
        )));
    }
    let optimizer = r.string(name_len, "optimizer name")?;
    r.skip(header_len - FIXED_HEADER - name_len, "header extension")?;
    Ok(Header { fingerprint, server, step, unix_time_ms, slots, blocks, optimizer })
}

/// Read a whole file through `file` (from its start), checking everything,
/// and hand each block to `on_block` once it checked out. A mismatch with the
/// store found before the end is reported only after the CRC verified (a
/// corrupt file is called corrupt, not mismatching).
fn scan(
    file: &File,
    expect: &Expect,
    on_block: &mut dyn FnMut(BlockId, Vec<f32>, OptimizerState) -> Check<()>,
) -> Check<Scanned> {
    let mut f = file;
    f.seek(SeekFrom::Start(0)).map_err(|e| Reject::Io("seeking", e))?;
    let size = f.metadata().map_err(|e| Reject::Io("reading metadata", e))?.len();
    let smallest = FIXED_HEADER + 8 + TRAILER;
    if size < smallest {
        return Err(Reject::Corrupt(format!(
            "the file is {size} bytes, shorter than the smallest checkpoint ({smallest} bytes): truncated?"
        )));
    }
    let mut r = Body {
        inner: BufReader::with_capacity(IO_BUF, f),
        hasher: crc32fast::Hasher::new(),
        pos: 0,
        end: size - TRAILER,
    };
    let header = read_header(&mut r)?;
    let mut problem = header.mismatch(expect).map(Reject::Mismatch);
    let mut seqs = Vec::new();
    if problem.is_none() {
        problem = scan_blocks(&mut r, &header, expect, on_block)?;
    }
    if problem.is_none() {
        let n = r.u64("last-seq count")?;
        r.need(n.saturating_mul(SEQ_ENTRY_MIN), &format!("{n} last-seq entries"))?;
        for i in 0..n {
            let len = u64::from(r.u32("trainer id length")?);
            let trainer = r.string(len, &format!("trainer id of last-seq entry {i}"))?;
            let seq = r.u64("last seq")?;
            seqs.push((trainer, seq));
        }
    } else {
        // Only to tell corruption from a mismatch.
        r.skip(r.remaining(), "the rest")?;
    }
    let checksum = r.finish()?;
    match problem {
        Some(p) => Err(p),
        None => Ok(Scanned { header, seqs, checksum, bytes: size }),
    }
}

/// The blocks, in the store's order. `Err` for corruption, `Ok(Some)` for a
/// mismatch with the store (the caller still checks the CRC).
fn scan_blocks<R: Read>(
    r: &mut Body<R>,
    h: &Header,
    expect: &Expect,
    on_block: &mut dyn FnMut(BlockId, Vec<f32>, OptimizerState) -> Check<()>,
) -> Check<Option<Reject>> {
    r.need(h.blocks.saturating_mul(BLOCK_HEAD), &format!("{} blocks", h.blocks))?;
    for &(id, len) in &expect.blocks {
        let file_id = BlockId::new(r.u32("block id")?, r.u32("block id")?);
        let file_len = r.u64("block length")?;
        let opt_step = r.u64("block optimizer step")?;
        if file_id != id {
            return Ok(Some(Reject::Mismatch(format!(
                "block {file_id} in the file where this store holds {id}"
            ))));
        }
        if file_len != len as u64 {
            return Ok(Some(Reject::Mismatch(format!(
                "block {id} has {file_len} values in the file, this store's has {len}"
            ))));
        }
        let params = r.f32s(file_len, &format!("block {id} parameters"))?;
        let slots = r.f32s(file_len.saturating_mul(h.slots), &format!("block {id} optimizer slots"))?;
        for (what, v) in [("parameters", &params), ("optimizer slots", &slots)] {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Reject::Corrupt(format!(
                    "block {id} {what} hold non-finite value {} at index {i} (the model had diverged, or the file was altered)",
                    v[i]
                )));
            }
        }
        on_block(id, params, OptimizerState { step: opt_step, slots })?;
    }
    Ok(None)
}

fn load_path(path: &Path, store: &mut ParamStore) -> Check<CheckpointInfo> {
    let file = File::open(path).map_err(|e| Reject::Io("opening", e))?;
    let expect = Expect::of(store);
    // Pass 1: verify without touching the store.
    let first = scan(&file, &expect, &mut |_, _, _| Ok(()))?;
    // Pass 2: the same bytes again (same handle: a rename over the path
    // cannot change them), restored block by block.
    let second = scan(&file, &expect, &mut |id, params, state| {
        store.restore_block(id, params, state).map_err(|e| Reject::Corrupt(e.to_string()))
    })
    .map_err(|r| {
        Reject::Corrupt(format!(
            "the file changed on disk between its verification and its restore ({}); the store may be partly restored",
            r.reason()
        ))
    })?;
    if second.checksum != first.checksum {
        return Err(Reject::Corrupt(format!(
            "the file changed on disk between its verification (crc32 {:08x}) and its restore ({:08x}); the store may be partly restored",
            first.checksum, second.checksum
        )));
    }
    store.set_step(second.header.step);
    for (trainer, seq) in &second.seqs {
        store.restore_last_seq(trainer, *seq);
    }
    Ok(CheckpointInfo {
        path: path.display().to_string(),
        step: second.header.step,
        checksum: second.checksum,
        bytes: second.bytes,
        unix_time_ms: second.header.unix_time_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizer::Adam;
    use crate::placement::Placement;
    use crate::spec::{Init, ParamSpec};
    use crate::store::{Mode, Push};

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
        st.push(Push { trainer: "t".into(), seq: 3, step: 0, weight: 1.0, grads }).unwrap();
        st
    }

    /// Saved bytes of `trained()` and the directory holding them.
    fn saved() -> (tempfile::TempDir, CheckpointDir, PathBuf, Vec<u8>) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(tmp.path(), 0);
        let path = PathBuf::from(dir.save(&trained(), 2).unwrap().path);
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
    fn file_names_parse_only_checkpoints() {
        assert_eq!(step_of_name("ckpt-00000000000000000042.oarckpt"), Some(42));
        assert_eq!(step_of_name("ckpt-7.oarckpt"), Some(7));
        for bad in ["ckpt-.oarckpt", "ckpt-1.oarckpt.tmp", "ckpt-+1.oarckpt", "ckpt-1oarckpt", "x-1.oarckpt"]
        {
            assert_eq!(step_of_name(bad), None, "{bad}");
        }
        assert_eq!(step_of_name("ckpt-99999999999999999999999.oarckpt"), None, "overflow");
    }

    #[test]
    fn layout_matches_the_documented_format() {
        let (_t, _d, _p, b) = saved();
        assert_eq!(&b[..8], &MAGIC);
        assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), FORMAT_VERSION);
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 64, "60 + \"adam\"");
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), trained().fingerprint());
        assert_eq!(u64::from_le_bytes(b[28..36].try_into().unwrap()), 1, "step");
        assert_eq!(u32::from_le_bytes(b[44..48].try_into().unwrap()), 2, "Adam slots");
        assert_eq!(u64::from_le_bytes(b[48..56].try_into().unwrap()), 4, "blocks 5+5+2+3");
        assert_eq!(&b[60..64], b"adam");
        // 64 header + 4 * 24 block heads + 15 * 3 floats + 8 + (4 + 1 + 8) seq + 4 CRC.
        assert_eq!(b.len(), 64 + 4 * 24 + 15 * 3 * 4 + 8 + 13 + 4);
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
        b[56..60].copy_from_slice(&5u32.to_le_bytes());
        let err = load_err(&path, with_crc(b)).to_string();
        assert!(err.contains("does not fit in the 64-byte header"), "{err}");
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
        b[64 + 8..64 + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
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
        b[64 + 24 + 4..64 + 24 + 8].copy_from_slice(&f32::NAN.to_le_bytes());
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
        let err = CheckpointDir::new(&root, 0).save(&trained(), 2).unwrap_err();
        assert!(matches!(err, Error::CheckpointIo { action: "creating directory", .. }), "{err}");
        assert!(err.to_string().contains("plain-file"), "{err}");
        let missing = tmp.path().join("nope.oarckpt");
        let err = load_file(&missing, &mut store(1)).unwrap_err().to_string();
        assert!(err.contains("nope.oarckpt") && err.contains("opening"), "{err}");
    }
}
