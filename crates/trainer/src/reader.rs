//! Data readers: turn a chunk of a line-oriented file (libsvm or CSV) into
//! [`Example`]s.
//!
//! Both formats share these rules: blank lines and lines starting with `#` are
//! skipped; surrounding whitespace (including a `\r` line ending) is ignored;
//! feature values must be finite numbers. A line that is not valid UTF-8 is
//! a bad line: skipped and counted with `skip_bad_lines` like any other (one
//! stray byte, a Latin-1 `é`, must not cost a whole task); without it, it
//! fails the chunk, as a line that does not parse does.
//!
//! Labels: with `classes == 2`, `-1` and `0` mean class 0 and `1` and `+1` mean
//! class 1; otherwise the label is an integer in `[0, classes)`. A label written
//! as an integral float (`2.0`) is accepted.

use std::fmt;
use std::ops::ControlFlow;
use std::str::FromStr;

use oar_task_queue::{for_each_chunk_line_bytes, line_number_at, Chunk};
use serde::{Deserialize, Serialize};

use crate::model::Example;
use crate::{Error, Result};

/// A line-oriented data format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Format {
    /// `label idx:val idx:val ...` with 1-based feature indices.
    Libsvm,
    /// `label,f1,f2,...,fN`: dense, exactly `features` values, no header.
    Csv,
}

impl FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "libsvm" => Ok(Format::Libsvm),
            "csv" => Ok(Format::Csv),
            _ => Err(Error::BadConfig(format!(
                "unknown data format {s:?}; valid values are \"libsvm\" and \"csv\""
            ))),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Libsvm => "libsvm",
            Format::Csv => "csv",
        })
    }
}

/// How to read data lines.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReaderOptions {
    /// The file format.
    pub format: Format,
    /// Number of features: libsvm indices run `1..=features`; CSV lines hold
    /// exactly `features` values after the label.
    pub features: usize,
    /// Number of classes; labels must map into `[0, classes)`.
    pub classes: usize,
    /// Count and skip bad lines (that do not parse, or are not UTF-8)
    /// instead of failing the chunk.
    pub skip_bad_lines: bool,
}

/// Parses one line. `Ok(None)` for blank lines and `#` comments; `Err(reason)`
/// names the bad token.
pub fn parse_line(line: &str, opts: &ReaderOptions) -> std::result::Result<Option<Example>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    match opts.format {
        Format::Libsvm => parse_libsvm(line, opts).map(Some),
        Format::Csv => parse_csv(line, opts).map(Some),
    }
}

pub(crate) fn parse_label(token: &str, classes: usize) -> std::result::Result<u32, String> {
    let token = token.trim();
    let value: Option<f64> = token.parse::<f64>().ok().filter(|v| v.fract() == 0.0);
    if classes == 2 {
        return match value {
            Some(-1.0 | 0.0) => Ok(0),
            Some(1.0) => Ok(1),
            _ => Err(format!("label {token:?} is not a binary label (expected -1, +1, 0 or 1)")),
        };
    }
    match value {
        Some(v) if v >= 0.0 && v < classes as f64 => Ok(v as u32),
        _ => Err(format!("label {token:?} is not an integer class in [0, {classes})")),
    }
}

pub(crate) fn parse_value(token: &str, what: impl Fn() -> String) -> std::result::Result<f32, String> {
    match token.trim().parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(format!("{} value {token:?} is not finite", what())),
        Err(_) => Err(format!("{} value {token:?} is not a number", what())),
    }
}

fn parse_libsvm(line: &str, opts: &ReaderOptions) -> std::result::Result<Example, String> {
    let mut tokens = line.split_ascii_whitespace();
    let label = parse_label(tokens.next().unwrap_or_default(), opts.classes)?;
    // One allocation of the right size per example (a trailing comment's
    // colons only make it larger): pushing into an empty Vec reallocates
    // three or four times for a typical line, and every allocation of the
    // reading thread contends with the training threads for the allocator.
    let mut features = Vec::with_capacity(line.bytes().filter(|&b| b == b':').count());
    for token in tokens {
        if token.starts_with('#') {
            break; // trailing comment
        }
        let (idx, val) =
            token.split_once(':').ok_or_else(|| format!("token {token:?} is not of the form index:value"))?;
        let index: u64 = idx
            .parse()
            .map_err(|_| format!("feature index {idx:?} in {token:?} is not a positive integer"))?;
        if index == 0 || index > opts.features as u64 {
            return Err(format!(
                "feature index {index} is out of range 1..={} (libsvm indices are 1-based)",
                opts.features
            ));
        }
        let value = parse_value(val, || format!("feature {index}"))?;
        // index <= features, and the model sizes fit in memory, so this fits in u32
        // whenever features does; otherwise reject rather than truncate.
        let zero_based =
            u32::try_from(index - 1).map_err(|_| format!("feature index {index} does not fit in 32 bits"))?;
        features.push((zero_based, value));
    }
    Ok(Example { label, features })
}

fn parse_csv(line: &str, opts: &ReaderOptions) -> std::result::Result<Example, String> {
    let mut fields = line.split(',');
    let label = parse_label(fields.next().unwrap_or_default(), opts.classes)?;
    let mut features = Vec::new();
    let mut got = 0usize;
    for (i, field) in fields.enumerate() {
        got += 1;
        if got > opts.features {
            continue; // counted for the error below
        }
        // Column 1 is the label, so feature i is column i + 2.
        let value = parse_value(field, || format!("column {} (feature {})", i + 2, i + 1))?;
        if value != 0.0 {
            let index = u32::try_from(i).map_err(|_| format!("column {} does not fit in 32 bits", i + 2))?;
            features.push((index, value));
        }
    }
    if got != opts.features {
        return Err(format!("expected {} feature values after the label, got {got}", opts.features));
    }
    Ok(Example { label, features })
}

/// The examples of one chunk, and how many bad lines were skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChunkData {
    /// Parsed examples, in file order.
    pub examples: Vec<Example>,
    /// Bad lines skipped (only with `skip_bad_lines`).
    pub skipped: usize,
}

/// Reads and parses the lines a chunk owns.
///
/// A bad line fails the chunk with [`Error::BadLine`] naming the file and the
/// 1-based line number, unless `skip_bad_lines` is set: then it is counted in
/// [`ChunkData::skipped`] and the chunk logs one warning naming the first one.
/// A line that is not valid UTF-8 is a bad line too when skipping (one stray
/// byte must not cost the whole chunk); without skipping it fails the chunk
/// with [`Error::Chunk`] naming the file and the byte offset.
pub fn read_chunk(chunk: &Chunk, opts: &ReaderOptions) -> Result<ChunkData> {
    let (examples, skipped) = parse_chunk(chunk, opts.skip_bad_lines, |line| parse_line(line, opts))?;
    Ok(ChunkData { examples, skipped })
}

/// The lines `chunk` owns, parsed by `parse` (`Ok(None)`: nothing on the
/// line), with the bad-line rules of [`read_chunk`]: the examples and how
/// many bad lines were skipped. Shared by every line reader.
pub(crate) fn parse_chunk<T>(
    chunk: &Chunk,
    skip_bad_lines: bool,
    parse: impl Fn(&str) -> std::result::Result<Option<T>, String>,
) -> Result<(Vec<T>, usize)> {
    let (mut examples, mut skipped) = (Vec::new(), 0);
    let mut first_bad: Option<(u64, String)> = None;
    let mut fatal: Option<(u64, String)> = None;
    let mut unreadable = None;
    for_each_chunk_line_bytes(chunk, |offset, line| {
        // A line that is not text is a bad line like any other when bad
        // lines are skipped; otherwise it fails the chunk as unreadable.
        let parsed = match std::str::from_utf8(line) {
            Ok(text) => parse(text),
            Err(e) if skip_bad_lines => {
                Err(format!("invalid UTF-8 at byte offset {}", offset + e.valid_up_to() as u64))
            }
            Err(e) => {
                unreadable = Some(oar_task_queue::Error::invalid_utf8(&chunk.path, offset, &e));
                return ControlFlow::Break(());
            }
        };
        match parsed {
            Ok(Some(example)) => examples.push(example),
            Ok(None) => {}
            Err(reason) if skip_bad_lines => {
                skipped += 1;
                if first_bad.is_none() {
                    first_bad = Some((offset, reason));
                }
            }
            Err(reason) => {
                fatal = Some((offset, reason));
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    })
    .and_then(|()| unreadable.map_or(Ok(()), Err))
    .map_err(|e| Error::Chunk(format!("{} bytes {}..{}: {e}", chunk.path, chunk.start, chunk.end)))?;
    if let Some((offset, reason)) = fatal {
        let (line, reason) = locate(&chunk.path, offset, reason);
        return Err(Error::BadLine { path: chunk.path.clone(), line, reason });
    }
    if let Some((offset, reason)) = first_bad {
        let (line, reason) = locate(&chunk.path, offset, reason);
        tracing::warn!(
            path = %chunk.path,
            skipped,
            "skipped {skipped} bad line(s) in chunk {}..{}; first at line {line}: {reason}",
            chunk.start,
            chunk.end
        );
    }
    Ok((examples, skipped))
}

/// The 1-based line number of the line at `offset`; if it cannot be found
/// (the file changed under us), line 0 with the byte offset in the reason.
fn locate(path: &str, offset: u64, reason: String) -> (u64, String) {
    match line_number_at(path, offset) {
        Ok(line) => (line, reason),
        Err(e) => (0, format!("{reason} (at byte offset {offset}; line number unknown: {e})")),
    }
}

/// Reads every file matching `pattern` whole (for evaluation sets), in path
/// order. A pattern that matches no file is an error; empty files add nothing.
pub fn read_glob(pattern: &str, opts: &ReaderOptions) -> Result<Vec<Example>> {
    let chunks = oar_task_queue::chunks_from_glob(pattern, WHOLE_FILE)
        .map_err(|e| Error::Chunk(format!("pattern {pattern:?}: {e}")))?;
    examples_of(pattern, &chunks, opts)
}

/// Reads the files matching `pattern` whole if they hold at most
/// `max_bytes`; otherwise an evenly spread sample of them: pieces of
/// [`SAMPLE_PIECE_BYTES`] (whole lines, as a task's chunk), taken at even
/// steps from the first file to the last, about `max_bytes` in all. The
/// sample is the same every time. For scoring a training set that need not
/// fit in memory; errors as [`read_glob`].
pub fn read_sample(pattern: &str, opts: &ReaderOptions, max_bytes: u64) -> Result<Vec<Example>> {
    examples_of(pattern, &sample_chunks(pattern, max_bytes)?, opts)
}

/// The chunks [`read_sample`] reads: the files whole, or the sample.
pub(crate) fn sample_chunks(pattern: &str, max_bytes: u64) -> Result<Vec<Chunk>> {
    let error = |e: oar_task_queue::Error| Error::Chunk(format!("pattern {pattern:?}: {e}"));
    let files = oar_task_queue::glob_files(pattern).map_err(error)?;
    if files.iter().map(|(_, len)| len).sum::<u64>() <= max_bytes {
        return oar_task_queue::chunk_files(&files, WHOLE_FILE).map_err(error);
    }
    let pieces = oar_task_queue::chunk_files(&files, SAMPLE_PIECE_BYTES).map_err(error)?;
    let take = (max_bytes / SAMPLE_PIECE_BYTES).clamp(1, pieces.len() as u64) as usize;
    Ok((0..take).map(|i| pieces[i * pieces.len() / take].clone()).collect())
}

/// The pieces [`read_sample`] takes, bytes.
pub const SAMPLE_PIECE_BYTES: u64 = 1 << 20;

/// Reads and parses several chunks, in order, into one [`ChunkData`]
/// (a task's chunks, or an evaluation set's).
pub fn read_chunks(chunks: &[Chunk], opts: &ReaderOptions) -> Result<ChunkData> {
    let mut all = ChunkData::default();
    for chunk in chunks {
        let data = read_chunk(chunk, opts)?;
        all.examples.extend(data.examples);
        all.skipped += data.skipped;
    }
    Ok(all)
}

/// The examples of `chunks` of the files `pattern` matched, with one
/// warning for all their bad lines.
fn examples_of(pattern: &str, chunks: &[Chunk], opts: &ReaderOptions) -> Result<Vec<Example>> {
    let ChunkData { examples, skipped } = read_chunks(chunks, opts)?;
    if skipped > 0 {
        tracing::warn!(pattern, skipped, "skipped {skipped} bad line(s) in total");
    }
    Ok(examples)
}

/// A chunk size larger than any file, so each file is one chunk.
pub(crate) const WHOLE_FILE: u64 = 1 << 62;

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(format: Format, features: usize, classes: usize) -> ReaderOptions {
        ReaderOptions { format, features, classes, skip_bad_lines: false }
    }

    fn ex(label: u32, features: &[(u32, f32)]) -> Option<Example> {
        Some(Example { label, features: features.to_vec() })
    }

    #[test]
    fn format_from_str_lists_valid_values() {
        assert_eq!("libsvm".parse::<Format>().unwrap(), Format::Libsvm);
        assert_eq!("CSV".parse::<Format>().unwrap(), Format::Csv);
        let err = "json".parse::<Format>().unwrap_err().to_string();
        assert!(err.contains("json") && err.contains("libsvm") && err.contains("csv"), "{err}");
        assert_eq!(Format::Csv.to_string(), "csv");
    }

    #[test]
    fn libsvm_lines() {
        let o = opts(Format::Libsvm, 5, 2);
        assert_eq!(parse_line("+1 1:0.5 5:2\r", &o).unwrap(), ex(1, &[(0, 0.5), (4, 2.0)]));
        assert_eq!(parse_line("-1", &o).unwrap(), ex(0, &[]));
        assert_eq!(parse_line("0 2:1", &o).unwrap(), ex(0, &[(1, 1.0)]));
        assert_eq!(parse_line("1 2:1 # note", &o).unwrap(), ex(1, &[(1, 1.0)]));
        assert_eq!(parse_line("   ", &o).unwrap(), None);
        assert_eq!(parse_line("# header", &o).unwrap(), None);
        let o3 = opts(Format::Libsvm, 5, 3);
        assert_eq!(parse_line("2 3:1", &o3).unwrap(), ex(2, &[(2, 1.0)]));
    }

    #[test]
    fn libsvm_errors_name_the_token() {
        let o = opts(Format::Libsvm, 5, 2);
        let err = |l: &str| parse_line(l, &o).unwrap_err();
        let e = err("1 0:1");
        assert!(e.contains("index 0") && e.contains("1..=5"), "{e}");
        let e = err("1 6:1");
        assert!(e.contains("index 6") && e.contains("1..=5"), "{e}");
        let e = err("1 3:abc");
        assert!(e.contains("\"abc\"") && e.contains("feature 3"), "{e}");
        let e = err("1 3:inf");
        assert!(e.contains("not finite"), "{e}");
        let e = err("1 3=1");
        assert!(e.contains("\"3=1\""), "{e}");
        let e = err("2 3:1");
        assert!(e.contains("\"2\"") && e.contains("binary"), "{e}");
        let o3 = opts(Format::Libsvm, 5, 3);
        let e = parse_line("3 1:1", &o3).unwrap_err();
        assert!(e.contains("\"3\"") && e.contains("[0, 3)"), "{e}");
        let e = parse_line("-1 1:1", &o3).unwrap_err();
        assert!(e.contains("\"-1\""), "{e}");
    }

    #[test]
    fn csv_lines_and_errors() {
        let o = opts(Format::Csv, 3, 3);
        assert_eq!(parse_line("2, 0.5,0,-1", &o).unwrap(), ex(2, &[(0, 0.5), (2, -1.0)]));
        let e = parse_line("1,1,2", &o).unwrap_err();
        assert!(e.contains("expected 3") && e.contains("got 2"), "{e}");
        let e = parse_line("1,1,2,3,4", &o).unwrap_err();
        assert!(e.contains("expected 3") && e.contains("got 4"), "{e}");
        let e = parse_line("1,1,x,3", &o).unwrap_err();
        assert!(e.contains("\"x\"") && e.contains("column 3"), "{e}");
        let e = parse_line("label,a,b,c", &o).unwrap_err();
        assert!(e.contains("\"label\""), "{e}");
    }
    fn temp_file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    }

    const BAD_LIBSVM: &str = "+1 1:1 2:0.5\n# comment\n-1 1:1 7:2\n-1 2:1\n";
    const BAD_CSV: &str = "1,0,1\n0,1,0\n1,0,zz\n\n0,1,1\n";

    #[test]
    fn read_glob_errors_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        for (name, text, format, token) in [
            ("bad.libsvm", BAD_LIBSVM, Format::Libsvm, "index 7"),
            ("bad.csv", BAD_CSV, Format::Csv, "\"zz\""),
        ] {
            let path = temp_file(&dir, name, text);
            let o = opts(format, 2, 2);
            let err = read_glob(&path, &o).unwrap_err();
            match &err {
                Error::BadLine { path: p, line, reason } => {
                    assert_eq!((p.as_str(), *line), (path.as_str(), 3), "{err}");
                    assert!(reason.contains(token), "{err}");
                }
                other => panic!("expected BadLine, got {other}"),
            }
            let msg = err.to_string();
            assert!(msg.contains(&format!("{path}:3:")), "{msg}");
        }
    }

    #[test]
    fn read_chunk_errors_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = temp_file(&dir, "bad.libsvm", BAD_LIBSVM);
        // A chunk that starts mid-file: line numbers are still file lines.
        let chunk = Chunk { path: path.clone(), start: 5, end: BAD_LIBSVM.len() as u64 };
        let err = read_chunk(&chunk, &opts(Format::Libsvm, 2, 2)).unwrap_err();
        assert!(matches!(&err, Error::BadLine { line: 3, path: p, .. } if *p == path), "{err}");
        assert!(err.to_string().contains("index 7"), "{err}");
    }

    #[test]
    fn the_first_bad_line_fails_the_chunk_before_later_lines_are_read() {
        // Lines are parsed as they are read: a bad line 2 fails the chunk,
        // whatever comes after it (here a line that is not UTF-8, which
        // would fail the chunk as unreadable if it were read first).
        let dir = tempfile::tempdir().unwrap();
        let bytes = b"1 1:0.5\n1 9:1\n0 1:\xff\n";
        let path = temp_file(&dir, "late.libsvm", "");
        std::fs::write(&path, bytes).unwrap();
        let chunk = Chunk { path: path.clone(), start: 0, end: bytes.len() as u64 };
        let err = read_chunk(&chunk, &opts(Format::Libsvm, 2, 2)).unwrap_err();
        assert!(matches!(&err, Error::BadLine { line: 2, .. }), "{err}");
        // Skipping bad lines reads on, and skips the line that is not UTF-8 too.
        let mut skip = opts(Format::Libsvm, 2, 2);
        skip.skip_bad_lines = true;
        let data = read_chunk(&chunk, &skip).unwrap();
        assert_eq!((data.examples.len(), data.skipped), (1, 2));
    }

    #[test]
    fn a_line_that_is_not_utf8_is_a_bad_line_skipped_or_fails_the_chunk() {
        // A stray Latin-1 byte ("caf\xe9") on line 2 of 3.
        let dir = tempfile::tempdir().unwrap();
        let bytes = b"1 1:0.5\n0 1:1 # caf\xe9\n1 2:1\n";
        let path = temp_file(&dir, "latin1.libsvm", "");
        std::fs::write(&path, bytes).unwrap();
        let chunk = Chunk { path: path.clone(), start: 0, end: bytes.len() as u64 };
        let mut skip = opts(Format::Libsvm, 2, 2);
        skip.skip_bad_lines = true;
        let data = read_chunk(&chunk, &skip).unwrap();
        assert_eq!(data.skipped, 1, "the line is skipped and counted");
        assert_eq!(data.examples, [ex(1, &[(0, 0.5)]).unwrap(), ex(1, &[(1, 1.0)]).unwrap()]);
        // Without skipping, the chunk fails, naming the file and the byte.
        let err = read_chunk(&chunk, &opts(Format::Libsvm, 2, 2)).unwrap_err().to_string();
        assert!(err.contains(&path) && err.contains("invalid UTF-8 at byte offset 19"), "{err}");
    }

    #[test]
    fn features_fill_their_vec_exactly() {
        let o = opts(Format::Libsvm, 9, 2);
        let e = parse_line("1 1:0.5 3:1 9:-2 # a comment: with colons", &o).unwrap().unwrap();
        assert_eq!(e.features, vec![(0, 0.5), (2, 1.0), (8, -2.0)]);
        let e = parse_line("0 2:1 4:1", &o).unwrap().unwrap();
        assert_eq!(e.features.capacity(), 2, "one allocation of the right size");
    }

    #[test]
    fn skip_bad_lines_counts_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = temp_file(&dir, "bad.csv", BAD_CSV);
        let mut o = opts(Format::Csv, 2, 2);
        o.skip_bad_lines = true;
        let chunk = Chunk { path: path.clone(), start: 0, end: BAD_CSV.len() as u64 };
        let data = read_chunk(&chunk, &o).unwrap();
        assert_eq!(data.skipped, 1);
        let labels: Vec<u32> = data.examples.iter().map(|e| e.label).collect();
        assert_eq!(labels, vec![1, 0, 0]);
        assert_eq!(data.examples[2].features, vec![(0, 1.0), (1, 1.0)]);
        assert_eq!(read_glob(&path, &o).unwrap().len(), 3);
    }

    #[test]
    fn read_glob_of_nothing_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let pattern = format!("{}/*.libsvm", dir.path().display());
        let err = read_glob(&pattern, &opts(Format::Libsvm, 2, 2)).unwrap_err();
        assert!(err.to_string().contains("*.libsvm"), "{err}");
    }

    #[test]
    fn empty_and_comment_only_files_give_no_examples() {
        let dir = tempfile::tempdir().unwrap();
        temp_file(&dir, "a.libsvm", "");
        temp_file(&dir, "b.libsvm", "# nothing here\n\n");
        let pattern = format!("{}/*.libsvm", dir.path().display());
        let examples = read_glob(&pattern, &opts(Format::Libsvm, 2, 2)).unwrap();
        assert!(examples.is_empty());
    }

    #[test]
    fn read_sample_takes_whole_lines_spread_over_the_files() {
        let dir = tempfile::tempdir().unwrap();
        // Two files of 3-4 MiB; label = file, feature 1 = line number.
        let lines = 320_000;
        for (file, name) in ["a.libsvm", "b.libsvm"].iter().enumerate() {
            let text: String = (0..lines).map(|i| format!("{file} 1:{}\n", i + 1)).collect();
            assert!(text.len() as u64 > 3 * SAMPLE_PIECE_BYTES);
            temp_file(&dir, name, &text);
        }
        let pattern = format!("{}/*.libsvm", dir.path().display());
        let o = opts(Format::Libsvm, 1, 2);
        let whole = read_glob(&pattern, &o).unwrap();
        assert_eq!(read_sample(&pattern, &o, u64::MAX).unwrap(), whole);

        let sample = read_sample(&pattern, &o, 2 * SAMPLE_PIECE_BYTES).unwrap();
        // Two pieces of 1 MiB out of 8: the first of each file.
        let per_line = (2 * SAMPLE_PIECE_BYTES) as f64 / sample.len() as f64;
        assert!((9.0..=14.0).contains(&per_line), "{} examples", sample.len());
        for file in 0..2 {
            let numbers: Vec<f32> =
                sample.iter().filter(|e| e.label == file).map(|e| e.features[0].1).collect();
            assert!(!numbers.is_empty(), "nothing from file {file}");
            let expected: Vec<f32> = (1..=numbers.len()).map(|i| i as f32).collect();
            assert_eq!(numbers, expected, "file {file}: a run of whole lines from its start");
        }
    }

    #[test]
    fn reads_a1a() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/a1a");
        let examples = read_glob(path, &opts(Format::Libsvm, 123, 2)).unwrap();
        assert_eq!(examples.len(), 1605);
        assert!(examples.iter().all(|e| e.label <= 1));
        let positives = examples.iter().filter(|e| e.label == 1).count();
        assert!(positives > 0 && positives < examples.len());
        assert!(examples.iter().all(|e| e.features.iter().all(|&(i, v)| i < 123 && v == 1.0)));
    }

    proptest::proptest! {
        #[test]
        fn parse_line_never_panics(line in "\\PC{0,40}", csv in proptest::bool::ANY) {
            let o = opts(if csv { Format::Csv } else { Format::Libsvm }, 4, 3);
            if let Ok(Some(e)) = parse_line(&line, &o) {
                proptest::prop_assert!(e.label < 3);
                proptest::prop_assert!(e.features.iter().all(|&(i, v)| i < 4 && v.is_finite()));
            }
        }

        #[test]
        fn libsvm_round_trips(label in 0u32..3, feats in proptest::collection::btree_map(0u32..50, -1e6f32..1e6, 0..10)) {
            let o = opts(Format::Libsvm, 50, 3);
            let mut line = label.to_string();
            for (i, v) in &feats {
                line.push_str(&format!(" {}:{v}", i + 1));
            }
            let e = parse_line(&line, &o).unwrap().unwrap();
            proptest::prop_assert_eq!(e.label, label);
            proptest::prop_assert_eq!(e.features, feats.into_iter().collect::<Vec<_>>());
        }
    }
}
