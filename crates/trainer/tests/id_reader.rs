//! The id readers: libsvm ids past 32 bits, categorical CSV ids, bad lines
//! named by file and line or counted and skipped, and the a1a dataset.

use oar_pserver::{hash_str, SplitMix64};
use oar_task_queue::Chunk;
use oar_trainer::id_reader::{csv_id, parse_id_line, read_chunk_ids, read_glob_ids, IdReaderOptions};
use oar_trainer::reader::Format;
use oar_trainer::{Error, IdExample};

fn libsvm() -> IdReaderOptions {
    IdReaderOptions::new(Format::Libsvm)
}

fn csv() -> IdReaderOptions {
    IdReaderOptions::new(Format::Csv)
}

fn ex(label: u32, ids: &[(u64, f32)]) -> Option<IdExample> {
    Some(IdExample { label, ids: ids.to_vec() })
}

#[test]
fn options_default_to_binary_libsvm() {
    let o = IdReaderOptions::default();
    assert_eq!((o.format, o.classes, o.skip_bad_lines), (Format::Libsvm, 2, false));
}

#[test]
fn libsvm_ids_beyond_u32_are_accepted() {
    let o = libsvm();
    assert_eq!(
        parse_id_line("+1 4294967296:0.5 18446744073709551615:2 7:0\r", &o).unwrap(),
        ex(1, &[(4_294_967_296, 0.5), (u64::MAX, 2.0), (7, 0.0)])
    );
    assert_eq!(parse_id_line("-1 3:1 3:2 # note", &o).unwrap(), ex(0, &[(3, 1.0), (3, 2.0)]));
    assert_eq!(parse_id_line("0", &o).unwrap(), ex(0, &[]));
    assert_eq!(parse_id_line("  # comment", &o).unwrap(), None);
    assert_eq!(parse_id_line("", &o).unwrap(), None);
    let o3 = IdReaderOptions { classes: 3, ..libsvm() };
    assert_eq!(parse_id_line("2 9:1", &o3).unwrap(), ex(2, &[(9, 1.0)]));
}

#[test]
fn libsvm_errors_name_the_token() {
    let err = |l: &str| parse_id_line(l, &libsvm()).unwrap_err();
    let e = err("1 0:1");
    assert!(e.contains("id 0") && e.contains("\"0:1\""), "{e}");
    let e = err("1 abc:1");
    assert!(e.contains("\"abc\""), "{e}");
    let e = err("1 -4:1");
    assert!(e.contains("\"-4\""), "{e}");
    let e = err("1 18446744073709551616:1");
    assert!(e.contains("\"18446744073709551616\""), "{e}");
    let e = err("1 3:nan");
    assert!(e.contains("\"nan\"") && e.contains("not finite") && e.contains("feature 3"), "{e}");
    let e = err("1 3:-inf");
    assert!(e.contains("not finite"), "{e}");
    let e = err("1 3:x1");
    assert!(e.contains("\"x1\"") && e.contains("not a number"), "{e}");
    let e = err("1 3=1");
    assert!(e.contains("\"3=1\""), "{e}");
    let e = err("2 3:1");
    assert!(e.contains("\"2\"") && e.contains("binary"), "{e}");
}

#[test]
fn csv_ids_are_stable_and_column_dependent() {
    // The documented formula, computed independently.
    let golden = 0x9E37_79B9_7F4A_7C15u64;
    let formula = |j: u64, t: &str| SplitMix64::new(hash_str(t) ^ (j + 1).wrapping_mul(golden)).next_u64();
    assert_eq!(csv_id(0, "red"), formula(0, "red"));
    assert_eq!(csv_id(4, "42"), formula(4, "42"));
    // Pinned, so a change of the formula (which would orphan every trained
    // table) cannot go unnoticed.
    assert_eq!(csv_id(0, "red"), PINNED_RED);

    let o = csv();
    let e = parse_id_line("1,red,red, blue ,,", &o).unwrap().unwrap();
    assert_eq!(e.label, 1);
    assert_eq!(e.ids, vec![(csv_id(0, "red"), 1.0), (csv_id(1, "red"), 1.0), (csv_id(2, "blue"), 1.0)]);
    assert_ne!(csv_id(0, "red"), csv_id(1, "red"));
    assert_ne!(csv_id(0, "red"), csv_id(0, "Red"));
    // The same line gives the same ids, in any process.
    assert_eq!(parse_id_line("-1,red,red, blue ,,", &o).unwrap().unwrap().ids, e.ids);
    assert_eq!(parse_id_line("0,,, ", &o).unwrap(), ex(0, &[]));
    assert_eq!(parse_id_line("0", &o).unwrap(), ex(0, &[]));
    let e = parse_id_line("yes,a,b", &o).unwrap_err();
    assert!(e.contains("\"yes\""), "{e}");
}

/// `csv_id(0, "red")`, computed independently of the crate (Python, from the
/// formula).
const PINNED_RED: u64 = 8_838_539_307_918_455_636;

fn temp_file(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_string()
}

const BAD_LIBSVM: &str = "+1 1:1 5000000000:0.5\n# comment\n-1 1:1 0:2\n-1 2:1\n1 3:nan\n";

#[test]
fn errors_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = temp_file(&dir, "bad.libsvm", BAD_LIBSVM);
    let err = read_glob_ids(&path, &libsvm()).unwrap_err();
    match &err {
        Error::BadLine { path: p, line, reason } => {
            assert_eq!((p.as_str(), *line), (path.as_str(), 3), "{err}");
            assert!(reason.contains("\"0:2\""), "{err}");
        }
        other => panic!("expected BadLine, got {other}"),
    }
    assert!(err.to_string().contains(&format!("{path}:3:")), "{err}");

    // A chunk that starts past the bad line 3 meets line 5.
    let start = BAD_LIBSVM.find("-1 2:1").unwrap() as u64;
    let chunk = Chunk { path: path.clone(), start, end: BAD_LIBSVM.len() as u64 };
    let err = read_chunk_ids(&chunk, &libsvm()).unwrap_err();
    assert!(matches!(&err, Error::BadLine { line: 5, path: p, .. } if *p == path), "{err}");
    assert!(err.to_string().contains("\"nan\""), "{err}");

    let csv_path = temp_file(&dir, "bad.csv", "1,a,b\nmaybe,a\n");
    let err = read_glob_ids(&csv_path, &csv()).unwrap_err();
    assert!(
        err.to_string().contains(&format!("{csv_path}:2:")) && err.to_string().contains("\"maybe\""),
        "{err}"
    );
}

#[test]
fn skip_bad_lines_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = temp_file(&dir, "bad.libsvm", BAD_LIBSVM);
    let o = IdReaderOptions { skip_bad_lines: true, ..libsvm() };
    let chunk = Chunk { path: path.clone(), start: 0, end: BAD_LIBSVM.len() as u64 };
    let data = read_chunk_ids(&chunk, &o).unwrap();
    assert_eq!(data.skipped, 2);
    assert_eq!(
        data.examples,
        vec![ex(1, &[(1, 1.0), (5_000_000_000, 0.5)]).unwrap(), ex(0, &[(2, 1.0)]).unwrap()]
    );
    assert_eq!(read_glob_ids(&path, &o).unwrap().len(), 2);
}

#[test]
fn a_glob_of_nothing_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let pattern = format!("{}/*.libsvm", dir.path().display());
    let err = read_glob_ids(&pattern, &libsvm()).unwrap_err();
    assert!(err.to_string().contains("*.libsvm"), "{err}");
}

/// Lines of a file holding data (a last line without a newline counts).
fn data_lines(path: &str) -> usize {
    std::fs::read_to_string(path).unwrap().lines().filter(|l| !l.trim().is_empty()).count()
}

#[test]
fn reads_a1a_and_a1a_t() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata");
    for (name, expected) in [("a1a", 1605), ("a1a.t", 30956)] {
        let path = format!("{dir}/{name}");
        assert_eq!(data_lines(&path), expected, "{name}");
        let examples = read_glob_ids(&path, &libsvm()).unwrap();
        assert_eq!(examples.len(), expected, "{name}");
        let positives = examples.iter().filter(|e| e.label == 1).count();
        assert!(positives > 0 && positives < examples.len());
        assert!(examples.iter().all(|e| e.ids.iter().all(|&(id, v)| (1..=123).contains(&id) && v == 1.0)));
    }
}
