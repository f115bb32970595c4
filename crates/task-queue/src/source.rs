//! Where a streaming job's data comes from: a [`TaskSource`] the master polls
//! for chunks that arrived since a [`SourceMark`].
//!
//! Three sources: [`GlobSource`] (a fixed glob, today's dataset, closed from
//! the start), [`DirSource`] (a directory that grows; a file is data once it
//! is renamed into place) and [`FileSource`] (one appended file, read up to
//! its last newline). The master journals the mark it got with the tasks it
//! made of the chunks, in one write, and polls again from the journaled mark
//! after a restart: so every chunk is trained once, none skipped.
//!
//! Marks are encoded by this module (a format byte, then postcard) and are
//! opaque to the master; each kind checks that a mark is one of its own.
//! A mark outlives the binary that wrote it (the master stores it in every
//! snapshot, and a master of a later release resumes from it), so every
//! encoding ever written still decodes: a kind whose mark changes gets a
//! new variant, and keeps decoding the old one.
//!
//! Identities of files use the inode number, never the device number: the
//! device of a network file system (NFS) is numbered per mount, differently
//! on every host and after every remount, and device-mapper disks can be
//! renumbered at boot, so a master restarted on another host (or after a
//! reboot) would see every file as replaced or new. Inode numbers of local
//! and NFS file systems are stable; some FUSE file systems (gcsfuse, s3fs)
//! number inodes per mount, and are not supported as streaming sources.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::dataset::{chunk_files, cut, glob_files, Chunk};
use crate::{Error, Result};

/// A source's position: opaque bytes the master journals with its state and
/// hands back to `poll`. The empty mark is the start of the source.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SourceMark(pub Vec<u8>);

/// What one poll found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Polled {
    /// New complete data after the mark given, in the order to train it.
    pub chunks: Vec<Chunk>,
    /// The mark that covers everything returned so far (give it to the next poll).
    pub mark: SourceMark,
    /// The source is closed: `chunks` is the last of it; polling again returns nothing new.
    pub closed: bool,
    /// Bad input noticed, each naming the file (not fatal: the job goes on with
    /// the rest). A problem that persists is reported once per source value, not
    /// at every poll (a new value, as after a restart, reports it again).
    pub problems: Vec<String>,
    /// Where the source is, for a status display ("12 files, 3.4 MB" / "byte 123456 of 130000").
    pub position: String,
}

/// Where a streaming job's data comes from.
///
/// `poll(mark)` returns the complete data that arrived after `mark` and the
/// mark covering it. The contract, which makes a journaled mark exact:
///
/// * **Deterministic.** What `poll` returns (all but `problems`, which are
///   reported once per source value) depends only on the mark and on what
///   the source holds at the call. Marks returned in order
///   (`m0` = empty, `m1` from `poll(m0)`, `m2` from `poll(m1)`, ...) split the
///   data: every record is in the chunks of exactly one of those polls
///   (what a record is, is each kind's: to a [`DirSource`], a file deleted
///   and put back is new data). Polling an old mark again returns the same
///   data again (plus whatever arrived since), so a master that lost a
///   poll's result before journaling it loses nothing by polling the
///   journaled mark again.
/// * **A mark only from this source**: the empty mark, or one this source
///   (same kind, same options) returned. A mark of another kind is an error;
///   one of another source of the same kind is not detected.
/// * **Closed is final.** Once a poll says `closed`, polling its mark returns
///   no chunks, `closed` and the same mark, whatever the file system holds
///   then: the close is in the mark.
/// * **Closed from outside** ([`close`](Self::close), the master's close
///   key) is a poll that closes as the source's own marker does: it takes
///   every complete record and reports, in `problems`, what it leaves
///   untrained (a last line without its newline, a file never completed).
///   So a stream ends the same whichever way the operator closes it.
/// * **Slow.** `poll` lists directories, stats and reads files: run it off
///   the async runtime (`spawn_blocking`). It is `Send` for that.
/// * **Errors** mean this poll returned nothing; the mark given is still
///   valid. Some are passing (an I/O error), some permanent (a streamed file
///   replaced): each kind says which.
pub trait TaskSource: Send {
    /// What the source is, for logs and errors (e.g. `directory "/data/in"`).
    fn describe(&self) -> String;
    /// The data that arrived after `mark` (see the trait docs).
    fn poll(&mut self, mark: &SourceMark) -> Result<Polled>;
    /// The last poll: as [`poll`](Self::poll), but closing the source as if
    /// its marker had appeared, so the result is `closed` (see the trait
    /// docs). No default: a source that ignored it would drop, unreported,
    /// what its own close reports.
    fn close(&mut self, mark: &SourceMark) -> Result<Polled>;
}

/// The marker file whose presence closes a [`DirSource`].
pub const DEFAULT_CLOSED_MARKER: &str = "_CLOSED";

/// How many first bytes of a file its identity hashes.
const HEAD_BYTES: usize = 4096;
/// How old a file's change time must be for its head hash to be remembered.
const SETTLE: Duration = Duration::from_secs(1);
/// Block size for finding a file's last newline, reading backwards.
const SCAN_BLOCK: u64 = 64 * 1024;
/// First byte of every non-empty mark: its encoding's format. A kind's new
/// mark is a new variant of [`Mark`] under the same format; this changes
/// only if the whole encoding does.
const MARK_FORMAT: u8 = 1;
/// Bytes of one file's identity in a [`DirSource`] mark.
const ID_BYTES: usize = 24;

/// A mark's content, postcard-encoded after [`MARK_FORMAT`].
///
/// Postcard numbers variants by their position, and marks stored by earlier
/// releases must still decode: never remove, reorder or change a variant.
/// A kind whose mark changes gets a new variant at the end (its version),
/// and its source keeps reading the old one.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Mark {
    /// A [`GlobSource`] that returned everything: what it returned, for the position.
    Glob { files: u64, bytes: u64 },
    /// A [`DirSource`]'s first mark (still read, no longer written): the
    /// sorted identities ([`FileId::to_bytes`]) of every file ever taken.
    DirV1 { closed: bool, files: Vec<[u8; ID_BYTES]> },
    /// A [`FileSource`]: the file's inode, the offset taken up to, and the
    /// hash of the file's first `min(offset, 4096)` bytes.
    File { inode: u64, offset: u64, head: u64, closed: bool },
    /// A [`DirSource`] (see [`DirMark`]): how many files it ever took and
    /// their bytes, and the sorted identities of the files it remembers:
    /// those in the directory at the last poll (`present`), and those the
    /// last poll missed but the one before saw (`missed`). No identities
    /// once closed.
    Dir {
        closed: bool,
        taken_files: u64,
        taken_bytes: u64,
        present: Vec<[u8; ID_BYTES]>,
        missed: Vec<[u8; ID_BYTES]>,
    },
}

impl Mark {
    /// Errors only if serde does (it cannot for these types); never an
    /// empty mark, which would mean "from the start".
    fn encode(&self) -> Result<SourceMark> {
        postcard::to_extend(self, vec![MARK_FORMAT])
            .map(SourceMark)
            .map_err(|e| Error::Source(format!("cannot encode a source mark: {e}")))
    }

    /// `None` for the empty mark.
    fn decode(mark: &SourceMark, source: &str) -> Result<Option<Mark>> {
        let bytes = mark.0.as_slice();
        let Some((&format, body)) = bytes.split_first() else {
            return Ok(None);
        };
        let bad =
            |why: String| Error::Source(format!("{source}: the mark given is not one it returned: {why}"));
        if format != MARK_FORMAT {
            return Err(bad(format!("format {format}, expected {MARK_FORMAT}")));
        }
        match postcard::take_from_bytes::<Mark>(body) {
            Ok((m, [])) => Ok(Some(m)),
            Ok((_, rest)) => Err(bad(format!("{} bytes left over", rest.len()))),
            Err(e) => Err(bad(e.to_string())),
        }
    }
}

/// 64-bit FNV-1a: stable across platforms and releases.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// "3 files" / "1 file".
fn count_files(n: u64) -> String {
    if n == 1 {
        "1 file".into()
    } else {
        format!("{n} files")
    }
}

/// "120 bytes", "3.4 MB" (decimal units).
fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["KB", "MB", "GB", "TB", "PB"];
    if b < 1000 {
        return if b == 1 { "1 byte".into() } else { format!("{b} bytes") };
    }
    let mut v = b as f64 / 1000.0;
    let mut unit = 0;
    while v >= 1000.0 && unit + 1 < UNITS.len() {
        v /= 1000.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Whether `path` exists (as any kind of file, a dangling symlink included).
fn exists(path: &Path) -> Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Ok(false),
        Err(e) => Err(Error::io(&path.display().to_string(), "stat")(e)),
    }
}

fn check_chunk_bytes(chunk_bytes: u64) -> Result<()> {
    if chunk_bytes == 0 {
        return Err(Error::InvalidArgument("chunk_bytes must be at least 1, got 0".into()));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// GlobSource

/// A fixed dataset as a source: the files a glob pattern matches, all at the
/// first poll, closed from the start (what a batch job trains).
#[derive(Clone, Debug)]
pub struct GlobSource {
    pattern: String,
    chunk_bytes: u64,
}

impl GlobSource {
    /// The files `pattern` matches (see [`glob_files`]), cut into chunks of
    /// `chunk_bytes`.
    pub fn new(pattern: &str, chunk_bytes: u64) -> Self {
        Self { pattern: pattern.to_string(), chunk_bytes }
    }
}

impl TaskSource for GlobSource {
    fn describe(&self) -> String {
        format!("glob {:?}", self.pattern)
    }

    /// The empty mark: every chunk of [`chunks_from_glob`](crate::chunks_from_glob),
    /// closed. The mark it returned: nothing, closed. Errors as [`glob_files`]
    /// (no match, a bad pattern), at the first poll only.
    fn poll(&mut self, mark: &SourceMark) -> Result<Polled> {
        check_chunk_bytes(self.chunk_bytes)?;
        let position = |files: u64, bytes: u64| format!("{}, {}", count_files(files), human_bytes(bytes));
        match Mark::decode(mark, &self.describe())? {
            None => {
                let files = glob_files(&self.pattern)?;
                let chunks = chunk_files(&files, self.chunk_bytes)?;
                let (n, bytes) = (files.len() as u64, files.iter().map(|(_, len)| len).sum::<u64>());
                let mark = Mark::Glob { files: n, bytes }.encode()?;
                Ok(Polled { chunks, mark, closed: true, problems: Vec::new(), position: position(n, bytes) })
            }
            Some(Mark::Glob { files, bytes }) => Ok(Polled {
                mark: mark.clone(),
                closed: true,
                position: position(files, bytes),
                ..Polled::default()
            }),
            Some(other) => Err(wrong_kind(&self.describe(), &other)),
        }
    }

    /// As [`poll`](TaskSource::poll): a glob is closed from the start.
    fn close(&mut self, mark: &SourceMark) -> Result<Polled> {
        self.poll(mark)
    }
}

fn wrong_kind(source: &str, mark: &Mark) -> Error {
    let kind = match mark {
        Mark::Glob { .. } => "glob",
        Mark::DirV1 { .. } | Mark::Dir { .. } => "directory",
        Mark::File { .. } => "file",
    };
    Error::Source(format!("{source}: the mark given is not one it returned: it is a {kind} source's mark"))
}

// ---------------------------------------------------------------------------
// DirSource

/// Options of a [`DirSource`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirSourceOptions {
    /// The directory files arrive in.
    pub dir: PathBuf,
    /// Files are cut into chunks of at most this many bytes.
    pub chunk_bytes: u64,
    /// The name whose presence in `dir` closes the source ([`DEFAULT_CLOSED_MARKER`]).
    pub closed_marker: String,
}

impl DirSourceOptions {
    /// `dir`, chunks of `chunk_bytes`, closed by [`DEFAULT_CLOSED_MARKER`].
    pub fn new(dir: impl Into<PathBuf>, chunk_bytes: u64) -> Self {
        Self { dir: dir.into(), chunk_bytes, closed_marker: DEFAULT_CLOSED_MARKER.to_string() }
    }
}

/// A directory that grows: each file is data once it is complete, trained once.
///
/// **Writers' protocol.** Write a file under a name starting with `.` or
/// ending in `.tmp`, then rename it into place: a file is complete when its
/// name is neither. Never change a file after the rename. To end the
/// stream, create the marker file ([`DirSourceOptions::closed_marker`])
/// after the last rename.
///
/// **A file written in place** (`cp file dir/`, or appended to after the
/// rename) may be taken half-written, and is then seen again, longer. It
/// is told from a new file by keeping its inode and its first bytes (the
/// taken identity's head hash matches the longer file's first bytes), is
/// reported as a problem naming it, and only its bytes past those taken
/// are taken: a chunk owns the lines that start in it, read to their ends,
/// so the chunks taken before and the new ones split its lines, each
/// trained once. The decision: take, not refuse. Refusing would leave the
/// rest of the file untrained; taking it whole again (what an identity
/// alone does: a longer file is another identity) trained its first part
/// twice, with no warning. The cost of a file written in place: a line
/// being written when a poll took the file is trained cut (or fails as a
/// bad line) if a trainer reads it before it is complete. A file rewritten
/// otherwise (truncated, or its first bytes changed) is a new file, taken
/// whole.
///
/// **What is taken.** Regular files directly in the directory (no recursion;
/// symlinks followed), named neither like a file being written nor like the
/// marker, are cut into chunks of `chunk_bytes` (an empty file gives none but
/// is still taken). New files of one poll come in order of modification
/// time, then name. A chunk names its file by its path at the poll
/// (`dir/name`): a file renamed after being taken is not found by the trainer.
///
/// **Never twice.** The mark holds the identity of every file taken that is
/// still in the directory: its inode, size, and a 64-bit FNV-1a hash of its
/// first 4 KiB. A renamed or touched file keeps all three, so it is not taken
/// again, nor is a second hard link to it. A new file that reuses a deleted
/// file's inode (file systems do reuse them) differs in size or first bytes,
/// so it is taken. The blind spot: a new file with the inode, the size and
/// the first 4 KiB of a file taken and deleted less than two polls before is
/// taken for that file and never trained. The device number is left out on
/// purpose (see the [module docs](self)): files of one directory share a
/// file system.
///
/// **Forgetting.** A file taken is dropped from the mark once two
/// consecutive polls did not find it in the directory; the mark says of
/// each file whether the last poll missed it, so what a poll returns still
/// depends only on the mark and the directory. Not after one poll: a
/// listing concurrent with a rename may miss the file under both its names
/// (POSIX allows it), and a file forgotten then would be taken again at the
/// next poll. Hence:
///
/// * a file renamed within the directory is never taken again, whatever
///   its new name (hidden or `.tmp` ones too: a file present under a name
///   that is not data's, or present but unreadable, is held by its inode
///   and size);
/// * a file deleted from the directory (or moved out of it) and put back
///   after two polls or more is new data, taken whole again, even with the
///   same inode and bytes (`mv` out and back in keeps both). Back after
///   one poll only, it is the file taken, and not taken again;
/// * a file deleted after it was cut into tasks and before they were
///   trained is forgotten as any other: its tasks fail, naming it, as the
///   master fails a task whose file cannot be read.
///
/// **The mark** holds 24 bytes per file in the directory, plus those missed
/// by the last poll, and the count and bytes of the files taken since the
/// start (for the position, "12 files, 3.4 MB taken"): its size follows what
/// the directory holds, not its history. 40,000 files present make a 1 MB
/// mark, which the master stores with its state. A closed mark holds no
/// files. A mark of the first encoding (every file ever taken, none
/// forgotten) is still read: its files count as present at the last poll.
///
/// **Closed** when the marker exists at the start of a poll (checked before
/// listing, so every file renamed in before the marker was created is in
/// that listing), or at [`close`](TaskSource::close) (the master's close
/// key, read before it): that poll takes every complete file present and
/// reports, by path, files still named like files being written: they were
/// never completed and are not trained.
///
/// **Size of the mark**: 24 bytes per file present in the directory (a
/// file deleted is forgotten two polls later), stored with the master's
/// state at every poll that finds a new file; some 60,000 files reach
/// etcd's default request limit, where the master stops (it warns past
/// 3/4 of it: [`STATE_WARN_FRACTION`](crate::STATE_WARN_FRACTION)). A
/// long-running stream should have its files removed once trained
/// (removing one whose tasks are still open fails those tasks: keep, say,
/// the last hour's), or get fewer, larger files.
///
/// **Cost of a poll**: one directory listing and one `stat` per entry; a
/// file's first 4 KiB are read once per source value (then remembered by
/// inode, size, modification and change time: a file written since has a
/// new change time), and again, up to the size taken, when a file under 4
/// KiB is found longer with the inode of one taken. A file changed less
/// than a second before it was read is read again at the next poll: time
/// stamps are coarse (a clock tick), so a change within the same tick
/// would keep the stamps it was remembered by. Entries that are not data (named like files being
/// written, or unreadable) are stat'ed only by a poll that misses a file
/// the mark holds.
///
/// Errors (passing ones: the next poll may succeed): the directory cannot
/// be listed (missing), the marker cannot be stat'ed. A file that vanishes
/// between the listing and its stat or read is missing from that listing
/// (a new one is taken when it is found; one taken is forgotten if the next
/// poll misses it too); one that cannot be read, or whose name is not
/// UTF-8, is a problem and skipped (held if taken before, see above; one
/// that cannot even be stat'ed counts as missing).
pub struct DirSource {
    options: DirSourceOptions,
    /// Head hashes read before, by [`HeadKey`].
    heads: HashMap<HeadKey, u64>,
    /// Problems reported already (each once per source value).
    reported: HashSet<String>,
}

impl fmt::Debug for DirSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirSource").field("options", &self.options).finish_non_exhaustive()
    }
}

/// What a file's identity is taken from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct FileId {
    inode: u64,
    len: u64,
    head: u64,
}

impl FileId {
    fn to_bytes(self) -> [u8; ID_BYTES] {
        let mut out = [0u8; ID_BYTES];
        out[0..8].copy_from_slice(&self.inode.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.head.to_le_bytes());
        out
    }

    fn from_bytes(b: &[u8; ID_BYTES]) -> Self {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Self { inode: word(0), len: word(8), head: word(16) }
    }
}

/// A file's state as far as its first bytes go: while none of these changed,
/// its first 4 KiB did not (any write moves the change time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct HeadKey {
    dev: u64,
    inode: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl HeadKey {
    fn of(meta: &fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            inode: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// Whether the file's change time is over [`SETTLE`] old: a later change
/// (a write, or a new file reusing its inode) then has another change time.
fn settled(meta: &fs::Metadata) -> bool {
    let Ok(now) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) else {
        return false;
    };
    let nanos = |secs: i64, nsec: i64| i128::from(secs) * 1_000_000_000 + i128::from(nsec);
    let ctime = nanos(meta.ctime(), meta.ctime_nsec());
    nanos(now.as_secs() as i64, i64::from(now.subsec_nanos())) - ctime >= SETTLE.as_nanos() as i128
}

/// A complete file found by a poll.
struct Found {
    mtime: (i64, i64),
    name: String,
    path: String,
    id: FileId,
}

/// What became of one directory entry.
enum Entry {
    File(Found),
    /// Not a regular file, or gone: nothing to say.
    Skip,
    /// Unreadable: a problem.
    Problem(String),
}

impl DirSource {
    /// A source over `options.dir`.
    pub fn new(options: DirSourceOptions) -> Self {
        Self { options, heads: HashMap::new(), reported: HashSet::new() }
    }

    /// The options it was built with.
    pub fn options(&self) -> &DirSourceOptions {
        &self.options
    }

    /// Adds `problem` unless it was reported before.
    fn note(&mut self, problems: &mut Vec<String>, problem: String) {
        if self.reported.insert(problem.clone()) {
            problems.push(problem);
        }
    }

    /// Stats and identifies one entry; `seen` collects the head keys in use.
    fn identify(&mut self, name: &str, path: &Path, seen: &mut HashSet<HeadKey>) -> Entry {
        let Some(path_str) = path.to_str() else {
            return Entry::Problem(format!(
                "{}: the path is not valid UTF-8 (chunks name their file as text); not trained",
                path.display()
            ));
        };
        let gone_or = |e: io::Error, op: &str| {
            if e.kind() == io::ErrorKind::NotFound {
                Entry::Skip
            } else {
                Entry::Problem(format!("{path_str}: {op}: {e}; skipped"))
            }
        };
        let meta = match fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) => return gone_or(e, "stat"),
        };
        // Only regular files: a directory is not data, and opening a FIFO would block.
        if !meta.is_file() {
            return Entry::Skip;
        }
        let key = HeadKey::of(&meta);
        let (meta, head) = match self.heads.get(&key) {
            Some(&head) => (meta, head),
            None => {
                let file = match File::open(path) {
                    Ok(file) => file,
                    Err(e) => return gone_or(e, "open"),
                };
                // The file opened may not be the one stat'ed (replaced in between): use its own.
                let meta = match file.metadata() {
                    Ok(meta) if meta.is_file() => meta,
                    Ok(_) => return Entry::Skip,
                    Err(e) => return gone_or(e, "stat"),
                };
                let mut first = Vec::with_capacity(HEAD_BYTES);
                if let Err(e) = file.take(HEAD_BYTES as u64).read_to_end(&mut first) {
                    return gone_or(e, "read");
                }
                let head = fnv1a64(&first);
                if settled(&meta) {
                    self.heads.insert(HeadKey::of(&meta), head);
                }
                (meta, head)
            }
        };
        seen.insert(HeadKey::of(&meta));
        Entry::File(Found {
            mtime: (meta.mtime(), meta.mtime_nsec()),
            name: name.to_string(),
            path: path_str.to_string(),
            id: FileId { inode: meta.ino(), len: meta.len(), head },
        })
    }
}

/// The identity taken before that `f` grew from, written in place: one the
/// mark holds with `f`'s inode, shorter, not itself listed now, whose head
/// hash is that of `f`'s first bytes (up to its size, or 4 KiB). A new file
/// that reuses a deleted one's inode differs there, and is new data. The
/// longest such, if several.
fn grown_from(was: &DirMark, listed: &HashSet<FileId>, f: &Found) -> Option<FileId> {
    let below =
        FileId { inode: f.id.inode, len: 0, head: 0 }..FileId { inode: f.id.inode, len: f.id.len, head: 0 };
    was.files.range(below).rev().map(|(id, _)| *id).filter(|id| !listed.contains(id)).find(|old| {
        if old.len >= HEAD_BYTES as u64 {
            // Both heads hash the first 4 KiB.
            return old.head == f.id.head;
        }
        // Unreadable now: not known to be the same file, so a new one.
        let head = File::open(&f.path).and_then(|file| read_head(&file, old.len as usize));
        head.is_ok_and(|head| head.len() as u64 == old.len && fnv1a64(&head) == old.head)
    })
}

/// The (inode, size) of a regular file that is in the directory but not
/// identified as data (named like a file being written, or unreadable): a
/// file taken and renamed so, or made unreadable, is still there.
fn held_key(path: &Path) -> Option<(u64, u64)> {
    fs::metadata(path).ok().filter(fs::Metadata::is_file).map(|meta| (meta.ino(), meta.len()))
}

/// A [`DirSource`] mark, decoded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct DirMark {
    closed: bool,
    /// Files taken since the start, deleted ones included, and their bytes.
    taken_files: u64,
    taken_bytes: u64,
    /// The files remembered, each with whether the last poll missed it.
    files: BTreeMap<FileId, bool>,
}

impl DirMark {
    /// A mark of the first encoding: every file ever taken, all present.
    fn from_v1(closed: bool, files: &[[u8; ID_BYTES]]) -> Self {
        let files: BTreeMap<FileId, bool> = files.iter().map(|b| (FileId::from_bytes(b), false)).collect();
        let taken_bytes = files.keys().fold(0u64, |sum, id| sum.saturating_add(id.len));
        Self { closed, taken_files: files.len() as u64, taken_bytes, files }
    }

    /// `present` wins over `missed` (the encoder never writes a file in both).
    fn from_v2(
        closed: bool,
        taken_files: u64,
        taken_bytes: u64,
        present: &[[u8; ID_BYTES]],
        missed: &[[u8; ID_BYTES]],
    ) -> Self {
        let mut files: BTreeMap<FileId, bool> =
            missed.iter().map(|b| (FileId::from_bytes(b), true)).collect();
        files.extend(present.iter().map(|b| (FileId::from_bytes(b), false)));
        Self { closed, taken_files, taken_bytes, files }
    }

    fn encode(&self) -> Result<SourceMark> {
        let (mut present, mut missed) = (Vec::new(), Vec::new());
        // A closed mark is never listed against again: its files are not needed.
        if !self.closed {
            for (id, &was_missed) in &self.files {
                let list = if was_missed { &mut missed } else { &mut present };
                list.push(id.to_bytes());
            }
        }
        Mark::Dir {
            closed: self.closed,
            taken_files: self.taken_files,
            taken_bytes: self.taken_bytes,
            present,
            missed,
        }
        .encode()
    }

    fn position(&self) -> String {
        format!("{}, {} taken", count_files(self.taken_files), human_bytes(self.taken_bytes))
    }
}

impl TaskSource for DirSource {
    fn describe(&self) -> String {
        format!("directory {:?}", self.options.dir.display().to_string())
    }

    /// See [`DirSource`].
    fn poll(&mut self, mark: &SourceMark) -> Result<Polled> {
        self.poll_dir(mark, false)
    }

    /// As a poll that finds the marker (see [`DirSource`]).
    fn close(&mut self, mark: &SourceMark) -> Result<Polled> {
        self.poll_dir(mark, true)
    }
}

impl DirSource {
    /// A poll; `close_asked`: closing whether or not the marker exists.
    fn poll_dir(&mut self, mark: &SourceMark, close_asked: bool) -> Result<Polled> {
        check_chunk_bytes(self.options.chunk_bytes)?;
        let was = match Mark::decode(mark, &self.describe())? {
            None => DirMark::default(),
            Some(Mark::DirV1 { closed, files }) => DirMark::from_v1(closed, &files),
            Some(Mark::Dir { closed, taken_files, taken_bytes, present, missed }) => {
                DirMark::from_v2(closed, taken_files, taken_bytes, &present, &missed)
            }
            Some(other) => return Err(wrong_kind(&self.describe(), &other)),
        };
        if was.closed {
            let position = was.position();
            return Ok(Polled { mark: mark.clone(), closed: true, position, ..Polled::default() });
        }

        let dir = self.options.dir.clone();
        let dir_str = dir.display().to_string();
        // Before the listing: every file renamed in before the marker was
        // created is then in the listing.
        let closing = close_asked || exists(&dir.join(&self.options.closed_marker))?;
        let listing = fs::read_dir(&dir).map_err(Error::io(&dir_str, "list directory"))?;

        let mut problems = Vec::new();
        let mut found = Vec::new();
        let mut incomplete = Vec::new();
        // Entries present but not identified as data (see `held_key`).
        let mut others = Vec::new();
        let mut seen = HashSet::new();
        for entry in listing {
            let entry = entry.map_err(Error::io(&dir_str, "list directory"))?;
            let path = entry.path();
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str() else {
                let problem = format!(
                    "{}: the name is not valid UTF-8 (chunks name their file as text); not trained",
                    path.display()
                );
                self.note(&mut problems, problem);
                others.push(path);
                continue;
            };
            if name == self.options.closed_marker {
                continue;
            }
            if name.starts_with('.') || name.ends_with(".tmp") {
                if closing {
                    incomplete.push(path.display().to_string());
                }
                others.push(path);
                continue;
            }
            match self.identify(name, &path, &mut seen) {
                Entry::File(f) => found.push(f),
                Entry::Skip => {}
                Entry::Problem(p) => {
                    self.note(&mut problems, p);
                    others.push(path);
                }
            }
        }
        // Forget the heads of files no longer listed (deleted, or changed).
        self.heads.retain(|key, _| seen.contains(key));

        found.sort_by(|a, b| (a.mtime, &a.name).cmp(&(b.mtime, &b.name)));
        let listed: HashSet<FileId> = found.iter().map(|f| f.id).collect();
        let mut next = DirMark { closed: closing, files: BTreeMap::new(), ..was };
        // What to take of each file: (path, from, to).
        let mut files = Vec::new();
        // Identities taken before that files found grew from.
        let mut grown = HashSet::new();
        for f in found {
            // A file found is present (not missed). It is new unless the
            // mark holds it, or it is a second name (hard link) of a file
            // found earlier in this listing; or, new, it is a file taken
            // before that grew in place: then only its new bytes are taken.
            let first_name = next.files.insert(f.id, false).is_none();
            if first_name && !was.files.contains_key(&f.id) {
                let from = match grown_from(&was, &listed, &f) {
                    Some(old) => {
                        grown.insert(old);
                        let problem = format!(
                            "{}: written in place (it grew from {} to {} bytes after it was taken; \
                             a file must be complete when it is renamed in): only bytes {}..{} are \
                             taken now, and a line cut at byte {} may have been trained cut",
                            f.path, old.len, f.id.len, old.len, f.id.len, old.len
                        );
                        self.note(&mut problems, problem);
                        old.len
                    }
                    None => {
                        next.taken_files += 1;
                        0
                    }
                };
                next.taken_bytes = next.taken_bytes.saturating_add(f.id.len - from);
                files.push((f.path, from, f.id.len));
            }
        }
        // The files the mark holds that this listing missed (not grown
        // into a file found): held if still here under a name that is not
        // data's, else missed once, else forgotten.
        let missing: Vec<(FileId, bool)> = was
            .files
            .into_iter()
            .filter(|(id, _)| !next.files.contains_key(id) && !grown.contains(id))
            .collect();
        if !missing.is_empty() {
            let held: HashSet<(u64, u64)> = others.iter().filter_map(|path| held_key(path)).collect();
            for (id, was_missed) in missing {
                if held.contains(&(id.inode, id.len)) {
                    next.files.insert(id, false);
                } else if !was_missed {
                    next.files.insert(id, true);
                }
            }
        }
        let chunks = files
            .iter()
            .flat_map(|(path, from, to)| cut(path, *from, *to, self.options.chunk_bytes))
            .collect();

        incomplete.sort();
        for path in incomplete {
            let problem =
                format!("{path}: never completed (still named like a file being written); not trained");
            self.note(&mut problems, problem);
        }
        let position = next.position();
        let mark = next.encode()?;
        Ok(Polled { chunks, mark, closed: closing, problems, position })
    }
}

// ---------------------------------------------------------------------------
// FileSource

/// Options of a [`FileSource`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileSourceOptions {
    /// The file appended to.
    pub path: PathBuf,
    /// New data is cut into chunks of at most this many bytes.
    pub chunk_bytes: u64,
    /// The path whose existence closes the source (by default `path` with
    /// `.closed` appended: `/x/log.libsvm.closed`).
    pub closed_marker: PathBuf,
}

impl FileSourceOptions {
    /// `path`, chunks of `chunk_bytes`, closed by `path` + `.closed`.
    pub fn new(path: impl Into<PathBuf>, chunk_bytes: u64) -> Self {
        let path = path.into();
        let mut marker = path.clone().into_os_string();
        marker.push(".closed");
        Self { path, chunk_bytes, closed_marker: PathBuf::from(marker) }
    }
}

/// One file appended to, read by byte offset: each poll takes the whole
/// lines appended since the mark.
///
/// **Writers' protocol.** Only append, whole lines ending in `'\n'` (a line
/// being written is not taken until its newline arrives). To end the stream,
/// create the marker ([`FileSourceOptions::closed_marker`]) after the last
/// append: the poll that sees it takes the rest, and reports a last line
/// with no newline (not trained). A [`close`](TaskSource::close) (the
/// master's close key) does the same without the marker.
///
/// **The mark** is the file's inode, the offset taken up to (right after a
/// newline), and a hash of the file's first `min(offset, 4096)` bytes. A
/// poll errors, naming the file and the offset, if the file was replaced or
/// rotated (another inode, or gone), truncated (shorter than the offset), or
/// rewritten (its first bytes differ: a truncation followed by new appends,
/// as a copy-and-truncate rotation does). These errors are permanent: the
/// data after the mark is gone. (Not detected: a file truncated and
/// rewritten, between two polls, with its first 4 KiB as before and at
/// least as long as before.) While nothing was taken the mark stays empty,
/// so a file replaced before its first newline is no error.
///
/// New data is cut into chunks of at most `chunk_bytes` from the offset;
/// the last ends right after a newline, so each chunk's lines (the ones
/// starting in it) are complete.
///
/// A file that does not exist yet, at the start, is waited for. A poll
/// stats the file and reads its first 4 KiB and its new bytes backwards
/// to the last newline (a long line still being written is read again at
/// each poll).
#[derive(Clone, Debug)]
pub struct FileSource {
    options: FileSourceOptions,
}

impl FileSource {
    /// A source over `options.path`.
    pub fn new(options: FileSourceOptions) -> Self {
        Self { options }
    }

    /// The options it was built with.
    pub fn options(&self) -> &FileSourceOptions {
        &self.options
    }
}

/// The offset right after the last `'\n'` in `[from, to)` of `file`, if any.
fn last_newline_end(file: &File, from: u64, to: u64) -> io::Result<Option<u64>> {
    let mut buf = vec![0u8; SCAN_BLOCK.min(to.saturating_sub(from)) as usize];
    let mut hi = to;
    while hi > from {
        let lo = hi.saturating_sub(SCAN_BLOCK).max(from);
        let block = &mut buf[..(hi - lo) as usize];
        file.read_exact_at(block, lo)?;
        if let Some(i) = block.iter().rposition(|&b| b == b'\n') {
            return Ok(Some(lo + i as u64 + 1));
        }
        hi = lo;
    }
    Ok(None)
}

/// Reads up to `want` bytes from the start of `file` (fewer at its end).
fn read_head(file: &File, want: usize) -> io::Result<Vec<u8>> {
    let mut head = vec![0u8; want];
    let mut got = 0;
    while got < want {
        match file.read_at(&mut head[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    head.truncate(got);
    Ok(head)
}

impl TaskSource for FileSource {
    fn describe(&self) -> String {
        format!("file {:?}", self.options.path.display().to_string())
    }

    /// See [`FileSource`].
    fn poll(&mut self, mark: &SourceMark) -> Result<Polled> {
        self.poll_file(mark, false)
    }

    /// As a poll that finds the marker (see [`FileSource`]).
    fn close(&mut self, mark: &SourceMark) -> Result<Polled> {
        self.poll_file(mark, true)
    }
}

impl FileSource {
    /// A poll; `close_asked`: closing whether or not the marker exists.
    fn poll_file(&mut self, mark: &SourceMark, close_asked: bool) -> Result<Polled> {
        check_chunk_bytes(self.options.chunk_bytes)?;
        let described = self.describe();
        let prev = match Mark::decode(mark, &described)? {
            None => None,
            Some(Mark::File { inode, offset, head, closed }) => {
                if closed {
                    let position = format!("byte {offset}, closed");
                    return Ok(Polled { mark: mark.clone(), closed: true, position, ..Polled::default() });
                }
                Some((inode, offset, head))
            }
            Some(other) => return Err(wrong_kind(&described, &other)),
        };
        let path = &self.options.path;
        let path_str = path.to_str().ok_or_else(|| Error::NonUtf8Path(path.display().to_string()))?;
        let offset = prev.map_or(0, |(_, offset, _)| offset);
        let broken = |what: String| {
            Error::Source(format!(
                "{described}: {what} after byte {offset} was taken; a streamed file must only be appended to"
            ))
        };

        // Before the file: every append made before the marker is then seen.
        let closing = close_asked || exists(&self.options.closed_marker)?;
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if prev.is_some() {
                    return Err(broken("gone (removed or renamed away)".into()));
                }
                if !closing {
                    return Ok(Polled { position: format!("waiting for {path_str}"), ..Polled::default() });
                }
                let problem =
                    format!("{path_str}: the source was closed before the file appeared; nothing trained");
                let mark = Mark::File { inode: 0, offset: 0, head: fnv1a64(&[]), closed: true }.encode()?;
                let position = "byte 0, closed".to_string();
                return Ok(Polled {
                    mark,
                    closed: true,
                    problems: vec![problem],
                    position,
                    ..Polled::default()
                });
            }
            Err(e) => return Err(Error::io(path_str, "open")(e)),
        };
        let meta = file.metadata().map_err(Error::io(path_str, "stat"))?;
        if !meta.is_file() {
            return Err(Error::Source(format!("{described}: not a regular file")));
        }
        let (inode, len) = (meta.ino(), meta.len());
        let head =
            read_head(&file, len.min(HEAD_BYTES as u64) as usize).map_err(Error::io(path_str, "read"))?;
        if let Some((was_inode, _, was_head)) = prev {
            if inode != was_inode {
                return Err(broken(format!("replaced (inode {inode}, was {was_inode})")));
            }
            if len < offset {
                return Err(broken(format!("truncated to {len} bytes")));
            }
            let checked = offset.min(HEAD_BYTES as u64) as usize;
            if head.len() < checked {
                return Err(broken(format!("truncated to {} bytes", head.len())));
            }
            if fnv1a64(&head[..checked]) != was_head {
                return Err(broken(format!("rewritten (its first {checked} bytes changed)")));
            }
        }

        let end =
            last_newline_end(&file, offset, len).map_err(Error::io(path_str, "read"))?.unwrap_or(offset);
        let mut problems = Vec::new();
        if closing && end < len {
            problems.push(format!(
                "{path_str}: the last line (bytes {end}..{len}) has no newline at the close; not trained"
            ));
        }
        let chunks = cut(path_str, offset, end, self.options.chunk_bytes);
        let mark = if end == 0 && !closing {
            SourceMark::default()
        } else {
            // `head` holds min(len, 4096) >= min(end, 4096) bytes.
            let head = fnv1a64(&head[..(end.min(HEAD_BYTES as u64) as usize).min(head.len())]);
            Mark::File { inode, offset: end, head, closed: closing }.encode()?
        };
        Ok(Polled { chunks, mark, closed: closing, problems, position: format!("byte {end} of {len}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn marks_round_trip_and_dir_ids_are_fixed_width() {
        let id = FileId { inode: u64::MAX, len: 7, head: 1 << 63 };
        let other = FileId { inode: 1, len: 2, head: 3 };
        assert_eq!(FileId::from_bytes(&id.to_bytes()), id);
        let dir = |files: &[(FileId, bool)]| DirMark {
            closed: false,
            taken_files: 2,
            taken_bytes: 9,
            files: files.iter().copied().collect(),
        };
        let one = dir(&[(id, false)]).encode().unwrap();
        let two = dir(&[(id, false), (other, true)]).encode().unwrap();
        assert_eq!(two.0.len() - one.0.len(), ID_BYTES, "24 bytes per file, a missed one too");
        assert_eq!(decode_dir(&two), dir(&[(id, false), (other, true)]));
        // Closed: the counts stay (the position), the files go.
        let closed = DirMark { closed: true, ..dir(&[(id, false), (other, true)]) }.encode().unwrap();
        assert_eq!(decode_dir(&closed), DirMark { closed: true, ..dir(&[]) });
        for m in
            [Mark::Glob { files: 3, bytes: 9 }, Mark::File { inode: 1, offset: 2, head: 3, closed: true }]
        {
            assert_eq!(Mark::decode(&m.encode().unwrap(), "s").unwrap(), Some(m));
        }
        assert_eq!(Mark::decode(&SourceMark::default(), "s").unwrap(), None);
        let mut extra = one.clone();
        extra.0.push(0);
        assert!(Mark::decode(&extra, "s").is_err());
        assert!(Mark::decode(&SourceMark(vec![9, 0]), "s").is_err());
    }

    /// The [`DirMark`] in a directory source's mark (of either encoding).
    fn decode_dir(mark: &SourceMark) -> DirMark {
        match Mark::decode(mark, "s").unwrap().unwrap() {
            Mark::DirV1 { closed, files } => DirMark::from_v1(closed, &files),
            Mark::Dir { closed, taken_files, taken_bytes, present, missed } => {
                DirMark::from_v2(closed, taken_files, taken_bytes, &present, &missed)
            }
            other => panic!("not a directory mark: {other:?}"),
        }
    }

    /// A directory mark of the first encoding, byte by byte as that release
    /// wrote it: the format, the variant (1), `closed`, the number of files,
    /// then 24 bytes per file.
    fn first_encoding(closed: bool, files: &[FileId]) -> SourceMark {
        let mut bytes = vec![1, 1, u8::from(closed), files.len() as u8];
        for id in files {
            bytes.extend(id.to_bytes());
        }
        SourceMark(bytes)
    }

    #[test]
    fn dir_mark_encodings_are_pinned_and_the_first_still_decodes() {
        let a = FileId { inode: 5, len: 100, head: 7 };
        let b = FileId { inode: 6, len: 200, head: 8 };
        let old = first_encoding(false, &[a, b]);
        assert_eq!(
            Mark::decode(&old, "s").unwrap(),
            Some(Mark::DirV1 { closed: false, files: vec![a.to_bytes(), b.to_bytes()] })
        );
        let files = [(a, false), (b, false)].into_iter().collect();
        assert_eq!(decode_dir(&old), DirMark { closed: false, taken_files: 2, taken_bytes: 300, files });

        // Today's: variant 3, `closed`, the counts (varints), then the present
        // files and the missed ones, each a count and 24 bytes a file.
        let files = [(a, false), (b, true)].into_iter().collect();
        let mark = DirMark { closed: false, taken_files: 5, taken_bytes: 300, files }.encode().unwrap();
        let mut want = vec![1, 3, 0, 5, 0xac, 0x02, 1];
        want.extend(a.to_bytes());
        want.push(1);
        want.extend(b.to_bytes());
        assert_eq!(mark.0, want);
    }

    /// The identity a poll gives the file at `path`.
    fn id_of(path: &Path) -> FileId {
        let meta = fs::metadata(path).unwrap();
        let bytes = fs::read(path).unwrap();
        FileId { inode: meta.ino(), len: meta.len(), head: fnv1a64(&bytes[..bytes.len().min(HEAD_BYTES)]) }
    }

    #[test]
    fn a_job_resumes_from_a_first_encoding_mark() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        fs::write(dir.join("x"), b"x1\nx2\n").unwrap();
        fs::write(dir.join("y"), b"y\n").unwrap();
        let x = id_of(&dir.join("x"));
        let gone = FileId { inode: x.inode.wrapping_add(1000), len: 40, head: 1 };
        let mut source = DirSource::new(DirSourceOptions::new(dir, 100));

        // x was taken, and so was a file deleted since; y is new.
        let p1 = source.poll(&first_encoding(false, &[x, gone])).unwrap();
        let y_path = dir.join("y").display().to_string();
        assert_eq!(p1.chunks, [Chunk { path: y_path, start: 0, end: 2 }]);
        assert_eq!(p1.position, "3 files, 48 bytes taken");
        let y = id_of(&dir.join("y"));
        let files = [(x, false), (y, false), (gone, true)].into_iter().collect();
        assert_eq!(decode_dir(&p1.mark), DirMark { closed: false, taken_files: 3, taken_bytes: 48, files });

        let p2 = source.poll(&p1.mark).unwrap();
        assert_eq!(p2.chunks, vec![]);
        assert_eq!(decode_dir(&p2.mark).files, [(x, false), (y, false)].into_iter().collect());
        assert_eq!(p2.position, "3 files, 48 bytes taken", "what was taken, deleted files included");

        // A closed one stays closed, as it was.
        let closed = first_encoding(true, &[x]);
        let p = source.poll(&closed).unwrap();
        assert_eq!(
            p,
            Polled {
                mark: closed,
                closed: true,
                position: "1 file, 6 bytes taken".into(),
                ..Polled::default()
            }
        );
    }

    #[test]
    fn the_mark_holds_the_files_present_and_those_missed_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let mut source = DirSource::new(DirSourceOptions::new(dir, 1 << 20));
        let mut mark = SourceMark::default();
        for round in 0..40u64 {
            for k in 0..3 {
                fs::write(dir.join(format!("r{round}-{k}")), format!("round {round} file {k}\n")).unwrap();
            }
            if round >= 2 {
                for k in 0..3 {
                    fs::remove_file(dir.join(format!("r{}-{k}", round - 2))).unwrap();
                }
            }
            let polled = source.poll(&mark).unwrap();
            assert_eq!(polled.chunks.len(), 3, "round {round}: its own files");
            mark = polled.mark;
            let m = decode_dir(&mark);
            // Present: this round's files and the last one's. Missed once:
            // the round before (present at the last poll). The rounds
            // before that were missed twice: forgotten.
            let present = m.files.values().filter(|&&missed| !missed).count();
            let missed = m.files.values().filter(|&&missed| missed).count();
            assert_eq!((present, missed), (3 * (round.min(1) as usize + 1), if round >= 2 { 3 } else { 0 }));
            assert_eq!(m.taken_files, 3 * (round + 1));
            assert!(mark.0.len() <= 9 * ID_BYTES + 16, "round {round}: {} bytes", mark.0.len());
        }
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 bytes");
        assert_eq!(human_bytes(1), "1 byte");
        assert_eq!(human_bytes(999), "999 bytes");
        assert_eq!(human_bytes(3_400_000), "3.4 MB");
        assert_eq!(human_bytes(u64::MAX), "18446.7 PB");
    }
}
