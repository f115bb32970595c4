//! Id readers: turn a chunk of a line-oriented file into [`IdExample`]s, whose
//! features are open-ended `u64` ids (rows of a sparse table) rather than
//! indices below a fixed feature count.
//!
//! The line rules are [`reader`](crate::reader)'s: blank lines and lines
//! starting with `#` are skipped, surrounding whitespace (a `\r` too) is
//! ignored, values must be finite, and labels are parsed the same way
//! (`-1`/`0` and `1`/`+1` with two classes, else an integer in
//! `[0, classes)`).
//!
//! - **libsvm**: `label id:value id:value ...`. The index as written is the
//!   id: any integer in `1..=u64::MAX` (0 is rejected, as libsvm indices are
//!   1-based; there is no upper bound because a table has none). A trailing
//!   `# comment` ends the line. A zero value is kept (it touches the row but
//!   adds nothing), as the dense reader keeps it.
//! - **CSV**: `label,f1,f2,...`, every field categorical. The non-empty
//!   field of 0-based column `j` (counting after the label) with trimmed text
//!   `t` becomes id [`csv_id`]`(j, t)` with value 1.0; an empty (or
//!   all-blank) field is a missing value and adds nothing. The same text in
//!   another column is another id. Lines may have any number of fields.

use oar_pserver::{hash_str, SplitMix64};
use oar_task_queue::Chunk;
use serde::{Deserialize, Serialize};

use crate::reader::{parse_label, parse_value, Format, WHOLE_FILE};
use crate::{Error, Result};

/// One example of a sparse model: a class label and `(id, value)` pairs.
#[derive(Clone, Debug, PartialEq)]
pub struct IdExample {
    /// Class index in `[0, classes)`.
    pub label: u32,
    /// `(id, value)` pairs in line order; absent ids are zero. Ids need not be
    /// sorted; a repeated id adds up.
    pub ids: Vec<(u64, f32)>,
}

/// How to read id data lines.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdReaderOptions {
    /// The file format.
    pub format: Format,
    /// Number of classes; labels must map into `[0, classes)`.
    pub classes: usize,
    /// Count and skip bad lines instead of failing the chunk.
    pub skip_bad_lines: bool,
}

impl IdReaderOptions {
    /// Binary labels (the CTR case), failing on bad lines.
    pub fn new(format: Format) -> Self {
        IdReaderOptions { format, classes: 2, skip_bad_lines: false }
    }
}

impl From<&crate::reader::ReaderOptions> for IdReaderOptions {
    /// The same format, classes and bad-line policy (ids need no feature count).
    fn from(opts: &crate::reader::ReaderOptions) -> Self {
        IdReaderOptions { format: opts.format, classes: opts.classes, skip_bad_lines: opts.skip_bad_lines }
    }
}

impl Default for IdReaderOptions {
    /// libsvm with binary labels, failing on bad lines.
    fn default() -> Self {
        Self::new(Format::Libsvm)
    }
}

/// SplitMix64's increment (the golden ratio), spreading column numbers over
/// 64 bits before they are mixed with the text's hash.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The id of the categorical value `text` in 0-based CSV column `column`
/// (counting after the label): stable across platforms, processes and
/// releases, so every trainer and every run agrees.
///
/// `csv_id(j, t) = splitmix64(fnv1a64(t) ^ ((j + 1) · 0x9E3779B97F4A7C15))`,
/// where `fnv1a64` is [`hash_str`] of the text as given (callers trim it),
/// `·` is wrapping multiplication, and `splitmix64(s)` is the first output of
/// [`SplitMix64::new`]`(s)`. Mixing the column in makes the same text in two
/// columns two different ids.
pub fn csv_id(column: usize, text: &str) -> u64 {
    let salt = (column as u64).wrapping_add(1).wrapping_mul(GOLDEN_GAMMA);
    SplitMix64::new(hash_str(text) ^ salt).next_u64()
}

/// Parses one line. `Ok(None)` for blank lines and `#` comments;
/// `Err(reason)` names the bad token.
pub fn parse_id_line(line: &str, opts: &IdReaderOptions) -> std::result::Result<Option<IdExample>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    match opts.format {
        Format::Libsvm => parse_libsvm_ids(line, opts.classes).map(Some),
        Format::Csv => parse_csv_ids(line, opts.classes).map(Some),
    }
}

fn parse_libsvm_ids(line: &str, classes: usize) -> std::result::Result<IdExample, String> {
    let mut tokens = line.split_ascii_whitespace();
    let label = parse_label(tokens.next().unwrap_or_default(), classes)?;
    let mut ids = Vec::new();
    for token in tokens {
        if token.starts_with('#') {
            break; // trailing comment
        }
        let (idx, val) =
            token.split_once(':').ok_or_else(|| format!("token {token:?} is not of the form id:value"))?;
        let id: u64 = match idx.parse() {
            Ok(0) => {
                return Err(format!("feature id 0 in {token:?} is out of range (libsvm ids are 1-based)"))
            }
            Ok(id) => id,
            Err(_) => return Err(format!("feature id {idx:?} in {token:?} is not an integer in 1..=2^64-1")),
        };
        let value = parse_value(val, || format!("feature {id}"))?;
        ids.push((id, value));
    }
    Ok(IdExample { label, ids })
}

fn parse_csv_ids(line: &str, classes: usize) -> std::result::Result<IdExample, String> {
    let mut fields = line.split(',');
    let label = parse_label(fields.next().unwrap_or_default(), classes)?;
    let ids = fields
        .enumerate()
        .filter_map(|(j, field)| {
            let text = field.trim();
            (!text.is_empty()).then(|| (csv_id(j, text), 1.0))
        })
        .collect();
    Ok(IdExample { label, ids })
}

/// The examples of one chunk, and how many bad lines were skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IdChunkData {
    /// Parsed examples, in file order.
    pub examples: Vec<IdExample>,
    /// Bad lines skipped (only with `skip_bad_lines`).
    pub skipped: usize,
}

/// Reads and parses the lines a chunk owns, as
/// [`read_chunk`](crate::reader::read_chunk) does.
///
/// A bad line fails the chunk with [`Error::BadLine`] naming the file and the
/// 1-based line number, unless `skip_bad_lines` is set: then it is counted in
/// [`IdChunkData::skipped`] and the chunk logs one warning naming the first.
pub fn read_chunk_ids(chunk: &Chunk, opts: &IdReaderOptions) -> Result<IdChunkData> {
    let (examples, skipped) =
        crate::reader::parse_chunk(chunk, opts.skip_bad_lines, |line| parse_id_line(line, opts))?;
    Ok(IdChunkData { examples, skipped })
}

/// Reads and parses several chunks, in order, into one [`IdChunkData`] (a
/// task's chunks).
pub fn read_chunks_ids(chunks: &[Chunk], opts: &IdReaderOptions) -> Result<IdChunkData> {
    let mut all = IdChunkData::default();
    for chunk in chunks {
        let data = read_chunk_ids(chunk, opts)?;
        all.examples.extend(data.examples);
        all.skipped += data.skipped;
    }
    Ok(all)
}

/// Reads every file matching `pattern` whole (for evaluation sets), in path
/// order, with one warning for all the bad lines skipped. A pattern that
/// matches no file is an error; empty files add nothing.
pub fn read_glob_ids(pattern: &str, opts: &IdReaderOptions) -> Result<Vec<IdExample>> {
    let chunks = oar_task_queue::chunks_from_glob(pattern, WHOLE_FILE)
        .map_err(|e| Error::Chunk(format!("pattern {pattern:?}: {e}")))?;
    id_examples_of(pattern, &chunks, opts)
}

/// [`read_sample`](crate::reader::read_sample) for id data: the files
/// whole if they hold at most `max_bytes`, else the same evenly spread sample.
pub fn read_sample_ids(pattern: &str, opts: &IdReaderOptions, max_bytes: u64) -> Result<Vec<IdExample>> {
    id_examples_of(pattern, &crate::reader::sample_chunks(pattern, max_bytes)?, opts)
}

fn id_examples_of(pattern: &str, chunks: &[Chunk], opts: &IdReaderOptions) -> Result<Vec<IdExample>> {
    let IdChunkData { examples, skipped } = read_chunks_ids(chunks, opts)?;
    if skipped > 0 {
        tracing::warn!(pattern, skipped, "skipped {skipped} bad line(s) in total");
    }
    Ok(examples)
}
