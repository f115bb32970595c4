//! Dataset partitioning: files cut into byte-range chunks, chunks grouped
//! into tasks, and the reader that turns a chunk back into its lines.
//!
//! A chunk owns every line that *starts* inside its byte range (a line starts
//! at byte 0 or right after a `'\n'`), read to its end even past the range.
//! So the chunks of one file partition its lines exactly, whatever the chunk
//! size, and no index of line offsets is needed: this is how line-oriented
//! formats (libsvm, CSV, JSON lines) are split.

use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::ops::ControlFlow;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Buffer size for reading chunks: large enough to amortise system calls,
/// small enough that many readers at once cost little.
const READ_BUFFER: usize = 64 * 1024;

/// The longest line a chunk's reader takes (64 MiB): a longer one fails
/// its chunk with [`Error::LineTooLong`] (with or without skipping bad
/// lines) instead of being read whole into memory: no record of a line
/// format is that long, and a file with no newline at all (a binary or a
/// one-line dump dropped among the data) would otherwise be read entire by
/// every trainer given a chunk of it.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// A byte range `[start, end)` of one file: a pointer to data, never the data.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// The file.
    pub path: String,
    /// First byte of the range.
    pub start: u64,
    /// One past the last byte of the range.
    pub end: u64,
}

impl fmt::Display for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}..{})", self.path, self.start, self.end)
    }
}

/// A task's id, unique within a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskId(pub u64);

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The unit of work handed to a trainer: a few chunks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    /// The task's id.
    pub id: TaskId,
    /// The chunks to read, in order.
    pub chunks: Vec<Chunk>,
}

/// Cuts files `(path, length)` into chunks of at most `chunk_bytes` bytes, in
/// the order given. The last chunk of a file may be shorter; an empty file
/// gives no chunk. Pure: nothing is read.
///
/// Errors if `chunk_bytes` is 0.
pub fn chunk_files(files: &[(String, u64)], chunk_bytes: u64) -> Result<Vec<Chunk>> {
    if chunk_bytes == 0 {
        return Err(Error::InvalidArgument("chunk_bytes must be at least 1, got 0".into()));
    }
    Ok(files.iter().flat_map(|(path, len)| cut(path, 0, *len, chunk_bytes)).collect())
}

/// Bytes `start..end` of `path` in chunks of `chunk_bytes` (at least 1),
/// the last one shorter.
pub(crate) fn cut(path: &str, start: u64, end: u64, chunk_bytes: u64) -> Vec<Chunk> {
    let mut chunks = Vec::new();
    let mut at = start;
    while at < end {
        let next = at.saturating_add(chunk_bytes).min(end);
        chunks.push(Chunk { path: path.to_string(), start: at, end: next });
        at = next;
    }
    chunks
}

/// Expands a glob pattern (regular files only, sorted by path), reads each
/// file's length and cuts the files into chunks with [`chunk_files`].
///
/// Errors naming the pattern if it is invalid or matches no regular file; a
/// pattern matching only empty files gives `Ok` with no chunks.
pub fn chunks_from_glob(pattern: &str, chunk_bytes: u64) -> Result<Vec<Chunk>> {
    if chunk_bytes == 0 {
        return Err(Error::InvalidArgument("chunk_bytes must be at least 1, got 0".into()));
    }
    chunk_files(&glob_files(pattern)?, chunk_bytes)
}

/// The regular files a glob pattern matches, with their lengths, sorted by
/// path. Errors naming the pattern if it is invalid or matches no regular file.
pub fn glob_files(pattern: &str) -> Result<Vec<(String, u64)>> {
    let entries = glob::glob(pattern)
        .map_err(|e| Error::BadPattern { pattern: pattern.to_string(), reason: e.to_string() })?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| {
            let path = e.path().display().to_string();
            Error::Io { path, op: "read directory while expanding glob", source: e.into() }
        })?;
        let name = path.to_str().ok_or_else(|| Error::NonUtf8Path(path.display().to_string()))?.to_string();
        let meta = std::fs::metadata(&path).map_err(Error::io(&name, "stat"))?;
        if meta.is_file() {
            files.push((name, meta.len()));
        }
    }
    if files.is_empty() {
        return Err(Error::NoMatch { pattern: pattern.to_string() });
    }
    files.sort();
    Ok(files)
}

/// Tasks per pass that [`auto_chunk_bytes`] aims at.
pub const AUTO_TASKS_PER_PASS: u64 = 32;
/// Smallest chunk [`auto_chunk_bytes`] picks.
pub const AUTO_CHUNK_MIN: u64 = 16 << 10;
/// Largest chunk [`auto_chunk_bytes`] picks.
pub const AUTO_CHUNK_MAX: u64 = 8 << 20;

/// A chunk size for `total_bytes` of data: about [`AUTO_TASKS_PER_PASS`]
/// chunks, rounded up to 4 KiB, between [`AUTO_CHUNK_MIN`] and
/// [`AUTO_CHUNK_MAX`].
///
/// Why: every task costs a trainer two calls to the master, a stored
/// report, a file opened and a push at its end, a few hundred microseconds
/// in all; a task must hold enough examples to hide that (a 16 KiB task of
/// a1a is 0.2 ms of training, so its overhead would dominate), yet a pass
/// needs enough tasks to keep several trainers busy and to lose little work
/// when one dies. Small data keeps the minimum, so that it still makes
/// several tasks.
pub fn auto_chunk_bytes(total_bytes: u64) -> u64 {
    let each = total_bytes.div_ceil(AUTO_TASKS_PER_PASS).div_ceil(4096).saturating_mul(4096);
    each.clamp(AUTO_CHUNK_MIN, AUTO_CHUNK_MAX)
}

/// Groups consecutive chunks into tasks of `chunks_per_task` chunks (the last
/// task may hold fewer), with ids `0..n` in order.
///
/// Errors if `chunks_per_task` is 0.
pub fn tasks_from_chunks(chunks: Vec<Chunk>, chunks_per_task: usize) -> Result<Vec<TaskSpec>> {
    if chunks_per_task == 0 {
        return Err(Error::InvalidArgument("chunks_per_task must be at least 1, got 0".into()));
    }
    let mut tasks = Vec::with_capacity(chunks.len().div_ceil(chunks_per_task));
    let mut iter = chunks.into_iter().peekable();
    let mut id = 0u64;
    while iter.peek().is_some() {
        let group: Vec<Chunk> = iter.by_ref().take(chunks_per_task).collect();
        tasks.push(TaskSpec { id: TaskId(id), chunks: group });
        id += 1;
    }
    Ok(tasks)
}

/// One line owned by a chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// Byte offset in the file at which the line starts (for error messages,
    /// see [`line_number_at`]).
    pub offset: u64,
    /// The line's text without its trailing `"\n"` or `"\r\n"`.
    pub text: String,
}

/// Reads the lines a chunk owns: every line that starts inside
/// `[start, end)`, each read to its end even if that is past `end`.
///
/// Reads through a buffer, never the whole file. A `"\r"` is stripped only
/// when it comes right before the `'\n'`. Errors name the file: it cannot be
/// opened or read, the chunk's range is reversed, or a line is not UTF-8 (then
/// with the byte offset of the first bad byte).
pub fn read_chunk_lines(chunk: &Chunk) -> Result<Vec<Line>> {
    let mut lines = Vec::new();
    for_each_chunk_line(chunk, |offset, text| {
        lines.push(Line { offset, text: text.to_string() });
        ControlFlow::Continue(())
    })?;
    Ok(lines)
}

/// [`read_chunk_lines`] without keeping the lines: `each` gets every line
/// the chunk owns in turn, with its byte offset, and may stop the reading
/// early with [`ControlFlow::Break`]. One line buffer serves the whole
/// chunk, so a chunk costs no allocation per line (readers that parse
/// lines into examples as they come use this).
pub fn for_each_chunk_line(chunk: &Chunk, mut each: impl FnMut(u64, &str) -> ControlFlow<()>) -> Result<()> {
    let mut bad = None;
    for_each_chunk_line_bytes(chunk, |offset, line| match std::str::from_utf8(line) {
        Ok(text) => each(offset, text),
        Err(e) => {
            bad = Some(Error::invalid_utf8(&chunk.path, offset, &e));
            ControlFlow::Break(())
        }
    })?;
    bad.map_or(Ok(()), Err)
}

/// [`for_each_chunk_line`] with each line's bytes as they are, UTF-8 or
/// not: for a reader that skips a line that is not text as it skips any
/// other bad line, instead of failing the chunk.
pub fn for_each_chunk_line_bytes(
    chunk: &Chunk,
    mut each: impl FnMut(u64, &[u8]) -> ControlFlow<()>,
) -> Result<()> {
    let path = chunk.path.as_str();
    if chunk.start > chunk.end {
        return Err(Error::BadChunk { path: path.to_string(), start: chunk.start, end: chunk.end });
    }
    if chunk.start == chunk.end {
        return Ok(());
    }
    let file = File::open(path).map_err(Error::io(path, "open"))?;
    let mut reader = BufReader::with_capacity(READ_BUFFER, file);
    // Find the first line starting at or after `start`: it starts right after
    // the first '\n' at or after `start - 1`.
    let mut pos = if chunk.start == 0 {
        0
    } else {
        let from = chunk.start - 1;
        reader.seek(SeekFrom::Start(from)).map_err(Error::io(path, "seek"))?;
        // No further than the chunk's end: past it, no line starts in the
        // chunk (a chunk inside a long line reads only itself).
        from + skip_through_newline(&mut (&mut reader).take(chunk.end - from))
            .map_err(Error::io(path, "read"))?
    };
    let mut buf = Vec::new();
    while pos < chunk.end {
        buf.clear();
        let limit = MAX_LINE_BYTES as u64 + 1;
        let n = (&mut reader).take(limit).read_until(b'\n', &mut buf).map_err(Error::io(path, "read"))?;
        if n == 0 {
            break;
        }
        // The limit reached without the newline: the line goes on.
        if n as u64 == limit && buf.last() != Some(&b'\n') {
            return Err(Error::LineTooLong { path: path.to_string(), offset: pos, max: MAX_LINE_BYTES });
        }
        let offset = pos;
        pos += n as u64;
        let mut line = buf.as_slice();
        if let Some(rest) = line.strip_suffix(b"\n") {
            line = rest.strip_suffix(b"\r").unwrap_or(rest);
        }
        if each(offset, line).is_break() {
            break;
        }
    }
    Ok(())
}

/// Consumes bytes up to and including the next `'\n'` (or to end of file)
/// without keeping them; returns how many were consumed.
fn skip_through_newline<R: BufRead>(reader: &mut R) -> std::io::Result<u64> {
    let mut skipped = 0u64;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(skipped);
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                reader.consume(i + 1);
                return Ok(skipped + i as u64 + 1);
            }
            None => {
                let n = buf.len();
                reader.consume(n);
                skipped += n as u64;
            }
        }
    }
}

/// The 1-based number of the line starting at byte `offset` of `path`: one
/// more than the number of `'\n'` before it. Reads the file up to `offset`,
/// so use it only to build error messages.
///
/// Errors if the file cannot be read or `offset` is past its end.
pub fn line_number_at(path: &str, offset: u64) -> Result<u64> {
    let file = File::open(path).map_err(Error::io(path, "open"))?;
    let len = file.metadata().map_err(Error::io(path, "stat"))?.len();
    if offset > len {
        return Err(Error::OffsetPastEnd { path: path.to_string(), offset, len });
    }
    let mut reader = BufReader::with_capacity(READ_BUFFER, file.take(offset));
    let mut newlines = 0u64;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io(path, "read")(e)),
        };
        if buf.is_empty() {
            break;
        }
        newlines += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        let n = buf.len();
        reader.consume(n);
    }
    Ok(newlines + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;

    #[test]
    fn auto_chunks_aim_at_a_number_of_tasks_within_bounds() {
        assert_eq!(auto_chunk_bytes(0), AUTO_CHUNK_MIN);
        assert_eq!(auto_chunk_bytes(116_421), AUTO_CHUNK_MIN, "a1a keeps the minimum");
        let a1a_x100 = 11_642_100;
        let each = auto_chunk_bytes(a1a_x100);
        assert_eq!(each % 4096, 0);
        assert_eq!(a1a_x100.div_ceil(each), AUTO_TASKS_PER_PASS);
        assert_eq!(auto_chunk_bytes(1 << 40), AUTO_CHUNK_MAX);
        assert_eq!(auto_chunk_bytes(u64::MAX), AUTO_CHUNK_MAX);
    }

    fn write_file(dir: &std::path::Path, name: &str, bytes: &[u8]) -> String {
        let path = dir.join(name);
        std::fs::File::create(&path).unwrap().write_all(bytes).unwrap();
        path.to_str().unwrap().to_string()
    }

    /// The reference: a file's lines with their offsets, by splitting it whole.
    fn reference_lines(bytes: &[u8]) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        let mut start = 0usize;
        while start < bytes.len() {
            let (line, next) = match bytes[start..].iter().position(|&b| b == b'\n') {
                Some(i) => {
                    let l = &bytes[start..start + i];
                    (l.strip_suffix(b"\r").unwrap_or(l), start + i + 1)
                }
                None => (&bytes[start..], bytes.len()),
            };
            out.push((start as u64, String::from_utf8(line.to_vec()).unwrap()));
            start = next;
        }
        out
    }

    #[test]
    fn a_line_past_the_limit_fails_its_chunk_without_being_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = b"0 1:1\n".to_vec();
        // A line of exactly the limit is taken; the next, one byte longer, is not.
        bytes.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES));
        bytes.push(b'\n');
        let long_at = bytes.len() as u64;
        bytes.extend(std::iter::repeat_n(b'y', MAX_LINE_BYTES + 1));
        let path = write_file(dir.path(), "no-newlines", &bytes);
        let chunk = Chunk { path: path.clone(), start: 0, end: bytes.len() as u64 };
        let mut lens = Vec::new();
        let err = for_each_chunk_line_bytes(&chunk, |_, line| {
            lens.push(line.len());
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert_eq!(lens, [5, MAX_LINE_BYTES], "the lines before it are handed out");
        assert!(
            matches!(&err, Error::LineTooLong { path: p, offset, max } if *p == path && *offset == long_at && *max == MAX_LINE_BYTES),
            "{err}"
        );
        assert!(err.to_string().contains("longer than"), "{err}");
    }

    #[test]
    fn chunk_files_cuts_and_skips_empty_files() {
        let files = vec![("a".to_string(), 10), ("empty".to_string(), 0), ("b".to_string(), 4)];
        let chunks = chunk_files(&files, 4).unwrap();
        let got: Vec<(&str, u64, u64)> = chunks.iter().map(|c| (c.path.as_str(), c.start, c.end)).collect();
        assert_eq!(got, vec![("a", 0, 4), ("a", 4, 8), ("a", 8, 10), ("b", 0, 4)]);
    }

    #[test]
    fn chunk_files_huge_chunk_size_does_not_overflow() {
        let chunks = chunk_files(&[("a".to_string(), u64::MAX - 1)], u64::MAX).unwrap();
        assert_eq!(chunks, vec![Chunk { path: "a".into(), start: 0, end: u64::MAX - 1 }]);
    }

    #[test]
    fn zero_sizes_are_errors() {
        let err = chunk_files(&[], 0).unwrap_err();
        assert!(err.to_string().contains("chunk_bytes"), "{err}");
        let err = tasks_from_chunks(vec![], 0).unwrap_err();
        assert!(err.to_string().contains("chunks_per_task"), "{err}");
    }

    #[test]
    fn tasks_group_consecutive_chunks() {
        let chunks = chunk_files(&[("a".to_string(), 5)], 1).unwrap();
        let tasks = tasks_from_chunks(chunks.clone(), 2).unwrap();
        assert_eq!(tasks.len(), 3);
        assert_eq!(tasks.iter().map(|t| t.id).collect::<Vec<_>>(), vec![TaskId(0), TaskId(1), TaskId(2)]);
        assert_eq!(tasks[0].chunks, chunks[0..2].to_vec());
        assert_eq!(tasks[2].chunks, chunks[4..5].to_vec());
        assert!(tasks_from_chunks(vec![], 3).unwrap().is_empty());
    }

    #[test]
    fn glob_sorts_files_skips_dirs_and_names_pattern() {
        let dir = tempfile::tempdir().unwrap();
        let b = write_file(dir.path(), "part-1.txt", b"0123456789");
        let a = write_file(dir.path(), "part-0.txt", b"abc");
        write_file(dir.path(), "part-2.txt", b"");
        std::fs::create_dir(dir.path().join("part-3.txt")).unwrap();
        let pattern = format!("{}/part-*.txt", dir.path().display());
        let chunks = chunks_from_glob(&pattern, 4).unwrap();
        let got: Vec<(String, u64, u64)> = chunks.into_iter().map(|c| (c.path, c.start, c.end)).collect();
        assert_eq!(
            got,
            vec![(a, 0, 3), (b.clone(), 0, 4), (b.clone(), 4, 8), (b, 8, 10)],
            "sorted, the empty file and the directory give no chunk"
        );

        let none = format!("{}/nothing-*.txt", dir.path().display());
        let err = chunks_from_glob(&none, 4).unwrap_err();
        assert!(matches!(err, Error::NoMatch { .. }));
        assert!(err.to_string().contains(&none), "{err}");

        let dirs_only = format!("{}/part-3*", dir.path().display());
        assert!(matches!(chunks_from_glob(&dirs_only, 4), Err(Error::NoMatch { .. })));

        let err = chunks_from_glob("/tmp/[", 4).unwrap_err();
        assert!(matches!(err, Error::BadPattern { .. }));
        assert!(err.to_string().contains("\"/tmp/[\""), "{err}");
    }

    #[test]
    fn reads_lines_owned_by_each_chunk() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), "f", b"aa\nbbbb\r\n\ncc");
        let read = |start, end| {
            read_chunk_lines(&Chunk { path: path.clone(), start, end })
                .unwrap()
                .into_iter()
                .map(|l| (l.offset, l.text))
                .collect::<Vec<_>>()
        };
        assert_eq!(read(0, 1), vec![(0, "aa".to_string())], "line read past the chunk's end");
        assert_eq!(read(1, 3), vec![], "no line starts in [1, 3)");
        assert_eq!(read(1, 4), vec![(3, "bbbb".to_string())]);
        assert_eq!(read(3, 13), vec![(3, "bbbb".into()), (9, "".into()), (10, "cc".into())]);
        assert_eq!(read(11, 100), vec![]);
        assert_eq!(read(50, 100), vec![], "a chunk past the end owns nothing");
        assert_eq!(read(5, 5), vec![]);
    }

    #[test]
    fn each_line_of_a_chunk_in_turn_until_told_to_stop() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), "f", b"aa\nbbbb\r\n\ncc\ndd");
        let chunk = Chunk { path: path.clone(), start: 1, end: 13 };
        let mut seen = Vec::new();
        for_each_chunk_line(&chunk, |offset, text| {
            seen.push(Line { offset, text: text.to_string() });
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(seen, read_chunk_lines(&chunk).unwrap());
        assert_eq!(seen.len(), 3, "{seen:?}");
        let mut seen = Vec::new();
        for_each_chunk_line(&chunk, |offset, text| {
            seen.push((offset, text.to_string()));
            if text.is_empty() {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
        assert_eq!(seen, vec![(3, "bbbb".to_string()), (9, String::new())], "stops at the break");
    }

    #[test]
    fn reversed_chunk_and_missing_file_are_errors() {
        let err = read_chunk_lines(&Chunk { path: "x".into(), start: 5, end: 2 }).unwrap_err();
        assert!(err.to_string().contains("start 5 is past end 2"), "{err}");
        let err =
            read_chunk_lines(&Chunk { path: "/nonexistent/oar/f".into(), start: 0, end: 2 }).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/oar/f"), "{err}");
        let err = line_number_at("/nonexistent/oar/f", 0).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/oar/f"), "{err}");
    }

    #[test]
    fn invalid_utf8_names_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), "bad", b"ok\nb\xffd\n");
        let err = read_chunk_lines(&Chunk { path: path.clone(), start: 0, end: 8 }).unwrap_err();
        match &err {
            Error::InvalidUtf8 { path: p, offset, line_start } => {
                assert_eq!(p, &path);
                assert_eq!(*offset, 4);
                assert_eq!(*line_start, 3);
            }
            other => panic!("expected InvalidUtf8, got {other:?}"),
        }
        assert!(err.to_string().contains(&path) && err.to_string().contains("offset 4"), "{err}");
        // The chunk that does not own the bad line reads fine.
        let ok = read_chunk_lines(&Chunk { path, start: 0, end: 3 }).unwrap();
        assert_eq!(ok, vec![Line { offset: 0, text: "ok".into() }]);
    }

    #[test]
    fn line_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), "f", b"a\n\nbc\nd");
        assert_eq!(line_number_at(&path, 0).unwrap(), 1);
        assert_eq!(line_number_at(&path, 2).unwrap(), 2);
        assert_eq!(line_number_at(&path, 3).unwrap(), 3);
        assert_eq!(line_number_at(&path, 6).unwrap(), 4);
        let err = line_number_at(&path, 8).unwrap_err();
        assert!(matches!(err, Error::OffsetPastEnd { offset: 8, len: 7, .. }), "{err}");
    }

    /// File contents built from pieces that exercise empty lines, "\r\n",
    /// a lone '\r', multi-byte characters and a missing final newline.
    fn contents() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just("a"),
            Just("bcd"),
            Just("\n"),
            Just("\n"),
            Just("\r\n"),
            Just("\r"),
            Just("é"),
            Just("xyz 1:0.5 "),
        ];
        prop::collection::vec(piece, 0..60).prop_map(|p| p.concat().into_bytes())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn chunks_partition_lines_exactly(bytes in contents(), chunk_bytes in 1u64..40) {
            let dir = tempfile::tempdir().unwrap();
            let path = write_file(dir.path(), "data", &bytes);
            let chunks = chunk_files(&[(path.clone(), bytes.len() as u64)], chunk_bytes).unwrap();
            let mut got = Vec::new();
            for c in &chunks {
                prop_assert!(c.end - c.start <= chunk_bytes);
                got.extend(read_chunk_lines(c).unwrap().into_iter().map(|l| (l.offset, l.text)));
            }
            let want = reference_lines(&bytes);
            prop_assert_eq!(&got, &want);
            for (i, (offset, _)) in want.iter().enumerate() {
                prop_assert_eq!(line_number_at(&path, *offset).unwrap(), i as u64 + 1);
            }
        }
    }
}
