//! The checkpoint file format (see the module docs of [`checkpoint`](super)
//! for the layout): a writer of a [`StoreSnapshot`] into any `Write`, and a
//! reader from any `Read + Seek` that verifies a whole file against a store
//! before it restores anything. No files, names or directories here: those
//! are [`CheckpointDir`](super::CheckpointDir)'s.
//!
//! **Non-finite values.** A checkpoint holds what the store held, NaN and
//! infinities included, and loads it back exactly: a model that diverged
//! (SGD's parameters past `f32::MAX`, say) is restored as it was, with
//! every update acknowledged before the save, rather than refused as
//! corrupt, which made the shard fall back to an older checkpoint (or to
//! nothing) and a follower's catch-up fail for good. The built-in
//! optimizers never turn a finite gradient into infinite state (see
//! [`optimizer`](crate::optimizer)), so only a true divergence gets here.
//! The file's CRC guards its bytes; besides, the header records how many
//! non-finite values the file holds (a header extension after the pushes
//! applied, `u64`, written only when there are some: a file of a finite
//! store is byte for byte what earlier builds wrote, and their readers skip
//! the field as the header length allows). A file whose header records
//! none and that holds one (named by block or row and index), or holds
//! another number than it records, is refused as altered. A file of a
//! diverged store written by an earlier build records none, and stays
//! refused as it was then (the reason says so). The format version stays 1:
//! what a file of version 1 may hold only grew.

use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::optimizer::OptimizerState;
use crate::origin::AppliedOrigins;
use crate::sparse::{Candidate, RowRecord, TableStats};
use crate::store::{count_non_finite, ParamStore, StoreSnapshot};

/// The first 8 bytes of every checkpoint file.
pub const MAGIC: [u8; 8] = *b"OARCKPT\0";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Header bytes before the optimizer name.
const FIXED_HEADER: u64 = 60;
/// Header bytes after the optimizer name: the pushes applied.
const HEADER_EXTENSION: u64 = 8;
/// More header bytes, in a file that holds non-finite values: how many.
const NON_FINITE_EXTENSION: u64 = 8;
/// param + block + len + optimizer step.
const BLOCK_HEAD: u64 = 24;
/// trainer id length + seq: the smallest last-seq entry.
const SEQ_ENTRY_MIN: u64 = 12;
const TRAILER: u64 = 4;
/// The read buffer, and the write buffer [`CheckpointDir`](super::CheckpointDir) uses.
pub(super) const IO_BUF: usize = 1 << 20;

// ---------------------------------------------------------------- writing

/// A snapshot checked for what the header must hold (lengths that fit
/// their fields), ready to be written: the checks come before any file is
/// created.
pub(super) struct Encoder<'a> {
    snapshot: &'a StoreSnapshot,
    name_len: u32,
    header_len: u32,
    slots: u32,
    /// The snapshot's NaN and infinite values (see the module docs).
    non_finite: u64,
}

impl<'a> Encoder<'a> {
    pub(super) fn new(snapshot: &'a StoreSnapshot) -> Result<Self> {
        let name = snapshot.optimizer();
        let too_big = |what: String| Error::Config(format!("cannot checkpoint: {what}"));
        let name_len = u32::try_from(name.len())
            .map_err(|_| too_big(format!("optimizer name of {} bytes is too long", name.len())))?;
        let non_finite = non_finite_in(snapshot);
        let extension = HEADER_EXTENSION + if non_finite > 0 { NON_FINITE_EXTENSION } else { 0 };
        let header_len = u32::try_from(FIXED_HEADER + u64::from(name_len) + extension)
            .map_err(|_| too_big(format!("optimizer name of {} bytes is too long", name.len())))?;
        let slots = u32::try_from(snapshot.state_slots())
            .map_err(|_| too_big(format!("{} optimizer state slots", snapshot.state_slots())))?;
        Ok(Self { snapshot, name_len, header_len, slots, non_finite })
    }

    /// Write the whole checkpoint, its CRC last, to `w` (buffer it: the
    /// floats go in one `write_all` per block, the rest in a few bytes at a
    /// time). Returns the CRC and the bytes written.
    pub(super) fn write<W: Write>(&self, w: &mut W, unix_time_ms: u64) -> io::Result<(u32, u64)> {
        let mut w = CrcWriter { inner: w, hasher: crc32fast::Hasher::new(), bytes: 0 };
        self.body(&mut w, unix_time_ms)?;
        let checksum = w.hasher.clone().finalize();
        w.inner.write_all(&checksum.to_le_bytes())?;
        Ok((checksum, w.bytes + TRAILER))
    }

    fn body<W: Write>(&self, w: &mut CrcWriter<W>, unix_time_ms: u64) -> io::Result<()> {
        let snap = self.snapshot;
        w.put(&MAGIC)?;
        w.u32(FORMAT_VERSION)?;
        w.u32(self.header_len)?;
        w.u64(snap.fingerprint())?;
        w.u32(snap.server())?;
        w.u64(snap.step())?;
        w.u64(unix_time_ms)?;
        w.u32(self.slots)?;
        w.u64(snap.blocks().len() as u64)?;
        w.u32(self.name_len)?;
        w.put(snap.optimizer().as_bytes())?;
        w.u64(snap.pushes())?;
        if self.non_finite > 0 {
            w.u64(self.non_finite)?;
        }
        for (id, params, state) in snap.blocks() {
            w.u32(id.param)?;
            w.u32(id.block)?;
            w.u64(params.len() as u64)?;
            w.u64(state.step)?;
            w.f32s(params)?;
            w.f32s(&state.slots)?;
        }
        // Sorted by trainer (see `StoreSnapshot`), so the same state always gives the same bytes.
        w.u64(snap.last_seqs().len() as u64)?;
        for (trainer, seq) in snap.last_seqs() {
            let len = u32::try_from(trainer.len())
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "trainer id longer than 4 GiB"))?;
            w.u32(len)?;
            w.put(trainer.as_bytes())?;
            w.u64(seq)?;
        }
        // The sparse tables, if the model has any (rows and candidates in
        // id order: the same table always gives the same bytes); a count of
        // 0 if there are none but origins follow.
        let origins = snap.origins();
        if !snap.tables().is_empty() || !origins.is_empty() {
            w.u64(snap.tables().len() as u64)?;
            for table in snap.tables() {
                let name = &table.spec().name;
                w.u32(
                    u32::try_from(name.len())
                        .map_err(|_| io::Error::other("table name longer than 4 GiB"))?,
                )?;
                w.put(name.as_bytes())?;
                w.u64(table.spec().dim as u64)?;
                let stats = table.stats();
                for counter in [stats.admitted, stats.evicted, stats.expired, stats.dropped_candidates] {
                    w.u64(counter)?;
                }
                w.u64(table.rows() as u64)?;
                for row in table.records() {
                    w.u64(row.id)?;
                    w.u64(row.step)?;
                    w.u32(row.count)?;
                    w.u64(row.last_seen)?;
                    w.f32s(row.params)?;
                    w.f32s(row.slots)?;
                }
                let candidates: Vec<Candidate> = table.candidates().collect();
                w.u64(candidates.len() as u64)?;
                for c in candidates {
                    w.u64(c.id)?;
                    w.u32(c.count)?;
                    w.u64(c.last_seen)?;
                }
            }
        }
        // The origins applied, if any (postcard; a map in key order, so the
        // same state always gives the same bytes).
        if !origins.is_empty() {
            let bytes = postcard::to_allocvec(origins).map_err(io::Error::other)?;
            w.u64(bytes.len() as u64)?;
            w.put(&bytes)?;
        }
        Ok(())
    }
}

/// The NaN and infinite values of `snapshot`'s blocks and rows: one more
/// pass over its values before any is written, at memory speed (the header
/// that records them comes first).
fn non_finite_in(snapshot: &StoreSnapshot) -> u64 {
    let blocks: u64 = snapshot
        .blocks()
        .map(|(_, params, state)| count_non_finite(params) + count_non_finite(&state.slots))
        .sum();
    let rows: u64 = snapshot
        .tables()
        .iter()
        .flat_map(|t| t.records())
        .map(|r| count_non_finite(r.params) + count_non_finite(r.slots))
        .sum();
    blocks + rows
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

// ---------------------------------------------------------------- reading

/// Why a file was refused.
#[derive(Debug)]
pub(super) enum Reject {
    Io(&'static str, io::Error),
    Corrupt(String),
    Mismatch(String),
    /// Refused during the restoring pass: the store is partly restored, so
    /// no older file may be loaded into it.
    Touched(String),
}

impl Reject {
    pub(super) fn reason(&self) -> String {
        match self {
            Reject::Io(action, e) => format!("I/O error {action}: {e}"),
            Reject::Corrupt(r) => format!("corrupt: {r}"),
            Reject::Mismatch(r) => format!("does not fit this pserver: {r}"),
            Reject::Touched(r) => format!("corrupt: {r}"),
        }
    }

    pub(super) fn into_error(self, path: &Path) -> Error {
        let path = path.to_path_buf();
        match self {
            Reject::Io(action, source) => Error::CheckpointIo { action, path, source },
            Reject::Corrupt(reason) | Reject::Touched(reason) => Error::CorruptCheckpoint { path, reason },
            Reject::Mismatch(reason) => Error::CheckpointMismatch { path, reason },
        }
    }
}

pub(super) type Check<T> = std::result::Result<T, Reject>;

/// What the store expects of a checkpoint.
struct Expect {
    server: u32,
    fingerprint: u64,
    optimizer: String,
    slots: u64,
    blocks: Vec<(BlockId, usize)>,
    /// The sparse tables' names and dims.
    tables: Vec<(String, u64)>,
    /// The most rows (and the most candidates) each table holds.
    table_caps: Vec<u64>,
}

impl Expect {
    fn of(store: &ParamStore) -> Self {
        Self {
            server: store.server(),
            fingerprint: store.fingerprint(),
            optimizer: store.optimizer().name().to_string(),
            slots: store.optimizer().state_slots() as u64,
            // By length, not values: a store made to be restored has none yet.
            blocks: store
                .block_ids()
                .filter_map(|id| store.block_len(id).ok().map(|len| (id, len)))
                .collect(),
            tables: store.tables().iter().map(|t| (t.spec().name.clone(), t.spec().dim as u64)).collect(),
            table_caps: store.tables().iter().map(|t| t.spec().policy.cap() as u64).collect(),
        }
    }
}

struct Header {
    fingerprint: u64,
    server: u32,
    step: u64,
    pushes: u64,
    unix_time_ms: u64,
    slots: u64,
    blocks: u64,
    optimizer: String,
    /// The NaN and infinite values the file holds, by its writer's count.
    non_finite: u64,
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
    /// The origins applied (empty in a file without them).
    origins: AppliedOrigins,
    /// Each table's life counters (its rows and candidates went to `on_row`).
    table_stats: Vec<TableStats>,
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
    let mut extension = header_len - FIXED_HEADER - name_len;
    let mut pushes = 0;
    if extension >= HEADER_EXTENSION {
        pushes = r.u64("pushes applied")?;
        extension -= HEADER_EXTENSION;
    }
    let mut non_finite = 0;
    if extension >= NON_FINITE_EXTENSION {
        non_finite = r.u64("non-finite value count")?;
        extension -= NON_FINITE_EXTENSION;
    }
    r.skip(extension, "header extension")?;
    Ok(Header { fingerprint, server, step, pushes, unix_time_ms, slots, blocks, optimizer, non_finite })
}

/// The non-finite values a scan met, against the count its header records.
struct NonFinite {
    recorded: u64,
    seen: u64,
}

impl NonFinite {
    /// Count those of `values` (`what` names them): a file that records
    /// none may hold none (the first is named), one that records `n` at most `n`.
    fn check(&mut self, values: &[f32], what: &dyn Fn() -> String) -> Check<()> {
        let n = count_non_finite(values);
        if n == 0 {
            return Ok(());
        }
        if self.recorded == 0 {
            let (i, v) = values.iter().enumerate().find(|(_, v)| !v.is_finite()).unwrap_or((0, &f32::NAN));
            return Err(Reject::Corrupt(format!(
                "{} hold non-finite value {v} at index {i}, where the header records none (the file was \
                 altered, or written by a build that did not record them)",
                what()
            )));
        }
        self.seen += n;
        if self.seen > self.recorded {
            return Err(Reject::Corrupt(format!(
                "{} bring the file's non-finite values past the {} its header records (the file was altered)",
                what(),
                self.recorded
            )));
        }
        Ok(())
    }

    /// The whole file read: as many as recorded.
    fn finish(&self) -> Check<()> {
        if self.seen != self.recorded {
            return Err(Reject::Corrupt(format!(
                "the header records {} non-finite values, the file holds {} (the file was altered)",
                self.recorded, self.seen
            )));
        }
        Ok(())
    }
}

/// Read a whole checkpoint through `r` (from its start to its end),
/// checking everything, and hand each block to `on_block` once it checked
/// out. A mismatch with the store found before the end is reported only
/// after the CRC verified (a corrupt file is called corrupt, not
/// mismatching).
fn scan<R: Read + Seek>(
    r: &mut R,
    expect: &Expect,
    on_block: &mut dyn FnMut(BlockId, Vec<f32>, OptimizerState) -> Check<()>,
    on_row: &mut dyn FnMut(usize, TableEntry<'_>) -> Check<()>,
) -> Check<Scanned> {
    let size = r.seek(SeekFrom::End(0)).map_err(|e| Reject::Io("seeking", e))?;
    r.seek(SeekFrom::Start(0)).map_err(|e| Reject::Io("seeking", e))?;
    let smallest = FIXED_HEADER + 8 + TRAILER;
    if size < smallest {
        return Err(Reject::Corrupt(format!(
            "the file is {size} bytes, shorter than the smallest checkpoint ({smallest} bytes): truncated?"
        )));
    }
    let mut r = Body {
        inner: BufReader::with_capacity(IO_BUF, r),
        hasher: crc32fast::Hasher::new(),
        pos: 0,
        end: size - TRAILER,
    };
    let header = read_header(&mut r)?;
    let mut problem = header.mismatch(expect).map(Reject::Mismatch);
    let mut seqs = Vec::new();
    let mut non_finite = NonFinite { recorded: header.non_finite, seen: 0 };
    if problem.is_none() {
        problem = scan_blocks(&mut r, &header, expect, &mut non_finite, on_block)?;
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
    }
    let mut table_stats = Vec::new();
    if problem.is_none() {
        match scan_tables(&mut r, &header, expect, &mut non_finite, on_row)? {
            Ok(stats) => table_stats = stats,
            Err(p) => problem = Some(p),
        }
    }
    let mut origins = AppliedOrigins::default();
    if problem.is_none() && r.remaining() > 0 {
        let len = r.u64("origins length")?;
        r.need(len, &format!("{len} bytes of origins"))?;
        let mut bytes = vec![0u8; to_usize(len, "origins")?];
        r.fill(&mut bytes)?;
        origins = postcard::from_bytes(&bytes)
            .map_err(|e| Reject::Corrupt(format!("the origins applied do not decode: {e}")))?;
    }
    if problem.is_some() {
        // Only to tell corruption from a mismatch.
        r.skip(r.remaining(), "the rest")?;
    }
    let checksum = r.finish()?;
    match problem {
        Some(p) => Err(p),
        None => {
            non_finite.finish()?;
            Ok(Scanned { header, seqs, origins, table_stats, checksum, bytes: size })
        }
    }
}

/// The blocks, in the store's order. `Err` for corruption, `Ok(Some)` for a
/// mismatch with the store (the caller still checks the CRC).
fn scan_blocks<R: Read>(
    r: &mut Body<R>,
    h: &Header,
    expect: &Expect,
    non_finite: &mut NonFinite,
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
            non_finite.check(v, &|| format!("block {id} {what}"))?;
        }
        on_block(id, params, OptimizerState { step: opt_step, slots })?;
    }
    Ok(None)
}

/// A table's row or candidate as a scan hands it on.
pub(super) enum TableEntry<'a> {
    Row(RowRecord<'a>),
    Candidate(Candidate),
}

/// The sparse tables section (absent in a file of a model without
/// tables): `Ok(Ok(stats))` per table, `Ok(Err)` for a mismatch with the
/// store, `Err` for corruption.
fn scan_tables<R: Read>(
    r: &mut Body<R>,
    h: &Header,
    expect: &Expect,
    non_finite: &mut NonFinite,
    on_row: &mut dyn FnMut(usize, TableEntry<'_>) -> Check<()>,
) -> Check<std::result::Result<Vec<TableStats>, Reject>> {
    let count = if r.remaining() == 0 { 0 } else { r.u64("table count")? };
    if count != expect.tables.len() as u64 {
        return Ok(Err(Reject::Mismatch(format!(
            "{count} sparse tables in the file, this store has {}",
            expect.tables.len()
        ))));
    }
    let mut all = Vec::with_capacity(expect.tables.len());
    for (t, (name, dim)) in expect.tables.iter().enumerate() {
        let len = u64::from(r.u32("table name length")?);
        let file_name = r.string(len, "table name")?;
        let file_dim = r.u64("table dim")?;
        if file_name != *name || file_dim != *dim {
            return Ok(Err(Reject::Mismatch(format!(
                "sparse table #{t} is {file_name:?} of dim {file_dim} in the file, {name:?} of dim {dim} in this store"
            ))));
        }
        let mut stats = TableStats {
            admitted: r.u64("table counter")?,
            evicted: r.u64("table counter")?,
            expired: r.u64("table counter")?,
            dropped_candidates: r.u64("table counter")?,
            ..TableStats::default()
        };
        // Every rule a fresh table's `restore_row` and `restore_candidate`
        // enforce is checked here, in both passes: a file refused for a row
        // is refused by the verifying pass, before the store changes. The
        // writer puts rows and candidates in ascending id order.
        let cap = expect.table_caps.get(t).copied().unwrap_or(0);
        let rows = r.u64("row count")?;
        if rows > cap {
            return Ok(Err(Reject::Mismatch(format!(
                "table {name:?} holds {rows} rows in the file, at most {cap} in this store"
            ))));
        }
        let floats = dim.saturating_mul(1 + h.slots);
        r.need(rows.saturating_mul(28 + floats * 4), &format!("{rows} rows of table {name:?}"))?;
        let corrupt = |what: &str, id: u64, why: String| {
            Reject::Corrupt(format!("{what} {id} of table {name:?} {why}"))
        };
        let mut row_ids: Vec<u64> = Vec::new();
        for _ in 0..rows {
            let id = r.u64("row id")?;
            let step = r.u64("row optimizer step")?;
            let count = r.u32("row count")?;
            let last_seen = r.u64("row last seen")?;
            let params = r.f32s(*dim, &format!("row {id} of table {name:?}"))?;
            let slots = r.f32s(dim.saturating_mul(h.slots), &format!("row {id} optimizer slots"))?;
            for (what, v) in [("parameters", &params), ("optimizer slots", &slots)] {
                non_finite.check(v, &|| format!("row {id} of table {name:?}: its {what}"))?;
            }
            if count == 0 {
                return Err(corrupt("row", id, "has count 0 (a held row was pushed at least once)".into()));
            }
            if let Some(&prev) = row_ids.last().filter(|&&prev| prev >= id) {
                return Err(corrupt("row", id, format!("follows row {prev}: ids must ascend, once each")));
            }
            row_ids.push(id);
            let row = RowRecord { id, params: &params, step, slots: &slots, count, last_seen };
            on_row(t, TableEntry::Row(row))?;
        }
        let candidates = r.u64("candidate count")?;
        if candidates > cap {
            return Ok(Err(Reject::Mismatch(format!(
                "table {name:?} holds {candidates} candidates in the file, at most {cap} in this store"
            ))));
        }
        r.need(candidates.saturating_mul(20), &format!("{candidates} candidates of table {name:?}"))?;
        let mut prev_candidate = None;
        for _ in 0..candidates {
            let c = Candidate {
                id: r.u64("candidate id")?,
                count: r.u32("candidate count")?,
                last_seen: r.u64("candidate last seen")?,
            };
            if c.count == 0 {
                return Err(corrupt(
                    "candidate",
                    c.id,
                    "has count 0 (a candidate was pushed at least once)".into(),
                ));
            }
            if let Some(prev) = prev_candidate.filter(|&prev| prev >= c.id) {
                return Err(corrupt(
                    "candidate",
                    c.id,
                    format!("follows candidate {prev}: ids must ascend, once each"),
                ));
            }
            if row_ids.binary_search(&c.id).is_ok() {
                return Err(corrupt("candidate", c.id, "is also a held row".into()));
            }
            prev_candidate = Some(c.id);
            on_row(t, TableEntry::Candidate(c))?;
        }
        stats.rows = to_usize(rows, "row count")?;
        stats.candidates = to_usize(candidates, "candidate count")?;
        all.push(stats);
    }
    Ok(Ok(all))
}

/// What a checkpoint that loaded held besides its blocks.
pub(super) struct Loaded {
    pub(super) step: u64,
    pub(super) checksum: u32,
    pub(super) bytes: u64,
    pub(super) unix_time_ms: u64,
}

/// Load the checkpoint read through `r` into `store`. Pass 1 verifies
/// everything without touching the store; only then pass 2 reads the same
/// bytes again and restores them block by block (one block of extra memory,
/// not a second copy of the store). The step and the last seqs are set last.
pub(super) fn load<R: Read + Seek>(r: &mut R, store: &mut ParamStore) -> Check<Loaded> {
    let expect = Expect::of(store);
    let first = scan(r, &expect, &mut |_, _, _| Ok(()), &mut |_, _| Ok(()))?;
    // Blocks and rows go to two closures that both restore into the store.
    let store = std::cell::RefCell::new(store);
    let second = scan(
        r,
        &expect,
        &mut |id, params, state| {
            store.borrow_mut().restore_block(id, params, state).map_err(|e| Reject::Corrupt(e.to_string()))
        },
        &mut |t, entry| {
            let mut store = store.borrow_mut();
            let table = store.table_mut(t as u32).map_err(|e| Reject::Corrupt(e.to_string()))?;
            match entry {
                TableEntry::Row(row) => table.restore_row(row),
                TableEntry::Candidate(c) => table.restore_candidate(c),
            }
            .map_err(|e| Reject::Corrupt(e.to_string()))
        },
    )
    .map_err(|r| {
        Reject::Touched(format!(
            "the file changed on disk between its verification and its restore ({}); the store may be partly restored",
            r.reason()
        ))
    })?;
    if second.checksum != first.checksum {
        return Err(Reject::Touched(format!(
            "the file changed on disk between its verification (crc32 {:08x}) and its restore ({:08x}); the store may be partly restored",
            first.checksum, second.checksum
        )));
    }
    let store = store.into_inner();
    for (t, stats) in second.table_stats.iter().enumerate() {
        if let Ok(table) = store.table_mut(t as u32) {
            table.restore_counters(stats);
        }
    }
    store.set_step(second.header.step);
    store.set_pushes(second.header.pushes);
    for (trainer, seq) in &second.seqs {
        store.restore_last_seq(trainer, *seq);
    }
    store.restore_origins(&second.origins);
    Ok(Loaded {
        step: second.header.step,
        checksum: second.checksum,
        bytes: second.bytes,
        unix_time_ms: second.header.unix_time_ms,
    })
}
