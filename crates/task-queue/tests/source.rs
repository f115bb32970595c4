//! Streaming task sources on real files: what each poll returns, that marks
//! returned in order hand out every byte once, and that a restart from a
//! journaled mark replays exactly.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use oar_task_queue::{
    read_chunk_lines, Chunk, DirSource, DirSourceOptions, Error, FileSource, FileSourceOptions, GlobSource,
    Polled, SourceMark, TaskSource,
};
use proptest::prelude::*;

fn path_str(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// Writes `name` the way a producer should: under a temporary name, then renamed.
fn write_complete(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, bytes).unwrap();
    let to = dir.join(name);
    fs::rename(&tmp, &to).unwrap();
    path_str(&to)
}

fn append(path: &Path, bytes: &[u8]) {
    OpenOptions::new().create(true).append(true).open(path).unwrap().write_all(bytes).unwrap();
}

fn set_mtime(path: &Path, t: SystemTime) {
    File::options().write(true).open(path).unwrap().set_modified(t).unwrap();
}

/// The texts of the lines the chunks own, in order.
fn lines(chunks: &[Chunk]) -> Vec<String> {
    chunks.iter().flat_map(|c| read_chunk_lines(c).unwrap()).map(|l| l.text).collect()
}

/// Asserts the chunks cover exactly `[0, len)` of each file named, without
/// overlap, and touch no other file.
fn assert_cover_exactly(chunks: &[Chunk], files: &[(String, u64)]) {
    let mut by_file: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for c in chunks {
        by_file.entry(&c.path).or_default().push((c.start, c.end));
    }
    for (path, len) in files {
        let mut ranges = by_file.remove(path.as_str()).unwrap_or_default();
        ranges.sort();
        let mut at = 0;
        for (start, end) in ranges {
            assert_eq!(start, at, "{path}: gap or overlap at {at}");
            assert!(end > start, "{path}: empty chunk at {start}");
            at = end;
        }
        assert_eq!(at, *len, "{path}: covered up to {at} of {len}");
    }
    assert!(by_file.is_empty(), "chunks of files not expected: {:?}", by_file.keys());
}

fn dir_source(dir: &Path, chunk_bytes: u64) -> DirSource {
    DirSource::new(DirSourceOptions::new(dir, chunk_bytes))
}

fn paths(chunks: &[Chunk]) -> Vec<String> {
    let mut out: Vec<String> = chunks.iter().map(|c| c.path.clone()).collect();
    out.dedup();
    out
}

// ---------------------------------------------------------------------------
// DirSource

#[test]
fn dir_takes_renamed_files_once_and_ignores_files_being_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 1 << 20);
    assert_eq!(source.describe(), format!("directory {:?}", path_str(dir)));

    fs::write(dir.join(".a.tmp"), b"a1\na2\n").unwrap();
    fs::write(dir.join("b.tmp"), b"b1\n").unwrap();
    fs::write(dir.join(".hidden"), b"h\n").unwrap();
    fs::create_dir(dir.join("sub")).unwrap();
    fs::write(dir.join("sub").join("deep"), b"d\n").unwrap();
    let p0 = source.poll(&SourceMark::default()).unwrap();
    assert!(p0.chunks.is_empty(), "files being written, dotfiles and subdirectories are not data: {p0:?}");
    assert!(!p0.closed && p0.problems.is_empty());
    assert_eq!(p0.position, "0 files, 0 bytes taken");

    fs::rename(dir.join(".a.tmp"), dir.join("a")).unwrap();
    let p1 = source.poll(&p0.mark).unwrap();
    assert_eq!(lines(&p1.chunks), ["a1", "a2"]);
    assert_eq!(p1.position, "1 file, 6 bytes taken");
    assert_eq!(source.poll(&p1.mark).unwrap().chunks, vec![], "taken once");

    // Renamed, touched, or linked under a second name: the same file, not taken again.
    fs::rename(dir.join("a"), dir.join("a-renamed")).unwrap();
    set_mtime(&dir.join("a-renamed"), SystemTime::now() + Duration::from_secs(60));
    fs::hard_link(dir.join("a-renamed"), dir.join("a-link")).unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(p2.chunks, vec![], "{p2:?}");
    assert_eq!(p2.mark, p1.mark);
    // A fresh source (a restarted master) reads the heads again and agrees.
    assert_eq!(dir_source(dir, 1 << 20).poll(&p1.mark).unwrap().chunks, vec![]);

    fs::rename(dir.join("b.tmp"), dir.join("b")).unwrap();
    let p3 = source.poll(&p2.mark).unwrap();
    assert_eq!(lines(&p3.chunks), ["b1"]);
    assert_eq!(paths(&p3.chunks), [path_str(&dir.join("b"))], "chunks name the file as found");
    assert_eq!(p3.position, "2 files, 9 bytes taken");
    assert_eq!(p3.mark.0.len() - p2.mark.0.len(), 24, "the mark grows by 24 bytes per file");
}

#[test]
fn dir_replay_is_deterministic_and_chained_marks_cover_every_byte_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 7);
    let mut files = Vec::new();
    let mut all = Vec::new();
    let mut marks = vec![SourceMark::default()];
    for round in 0..6u64 {
        for k in 0..round {
            let body: String =
                (0..=(round * 3 + k) % 5).map(|i| format!("r{round} f{k} line {i}\n")).collect();
            let name = format!("part-{round}-{k}");
            files.push((write_complete(dir, &name, body.as_bytes()), body.len() as u64));
        }
        let mark = marks.last().unwrap().clone();
        let polled = source.poll(&mark).unwrap();
        // Restart determinism: the same mark again, on this source and on a
        // fresh one, gives the same answer.
        assert_eq!(source.poll(&mark).unwrap(), polled);
        assert_eq!(dir_source(dir, 7).poll(&mark).unwrap(), polled);
        assert!(polled.chunks.iter().all(|c| c.end - c.start <= 7));
        all.extend(polled.chunks);
        marks.push(polled.mark);
    }
    assert_cover_exactly(&all, &files);

    // Replaying from an old mark returns exactly what followed it.
    let from_second = source.poll(&marks[2]).unwrap();
    let later: Vec<Chunk> =
        all.iter().filter(|c| !files[..1].iter().any(|(p, _)| *p == c.path)).cloned().collect();
    let mut want = later;
    want.sort_by(|a, b| (&a.path, a.start).cmp(&(&b.path, b.start)));
    let mut got = from_second.chunks;
    got.sort_by(|a, b| (&a.path, a.start).cmp(&(&b.path, b.start)));
    assert_eq!(got, want);
    assert_eq!(from_second.mark, *marks.last().unwrap());
}

#[test]
fn dir_orders_new_files_by_mtime_then_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    for (name, t) in [("c", t0 + Duration::from_secs(10)), ("a", t0 + Duration::from_secs(10)), ("b", t0)] {
        let path = write_complete(dir, name, format!("{name}\n").as_bytes());
        set_mtime(Path::new(&path), t);
    }
    let polled = dir_source(dir, 100).poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&polled.chunks), ["b", "a", "c"]);
}

#[test]
fn dir_marker_closes_takes_the_rest_and_reports_files_never_completed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 100);
    write_complete(dir, "x", b"x\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&p1.chunks), ["x"]);

    write_complete(dir, "y", b"y\n");
    fs::write(dir.join(".w.tmp"), b"half").unwrap();
    fs::write(dir.join("v.tmp"), b"half").unwrap();
    fs::write(dir.join("_CLOSED"), b"not data\n").unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    assert!(p2.closed);
    assert_eq!(lines(&p2.chunks), ["y"], "the file that arrived with the marker, and not the marker");
    let never = |name: &str| {
        format!(
            "{}: never completed (still named like a file being written); not trained",
            path_str(&dir.join(name))
        )
    };
    assert_eq!(p2.problems, [never(".w.tmp"), never("v.tmp")]);
    assert_eq!(p2.position, "2 files, 4 bytes taken");

    // Closed is final, even for files arriving later and with the marker gone.
    write_complete(dir, "z", b"z\n");
    fs::remove_file(dir.join("_CLOSED")).unwrap();
    for mut s in [source, dir_source(dir, 100)] {
        let p3 = s.poll(&p2.mark).unwrap();
        assert_eq!(
            p3,
            Polled {
                closed: true,
                mark: p2.mark.clone(),
                position: p2.position.clone(),
                ..Polled::default()
            }
        );
    }
}

#[test]
fn dir_a_new_file_under_a_deleted_files_name_is_taken() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 100);
    write_complete(dir, "f", b"one\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&p1.chunks), ["one"]);
    fs::remove_file(dir.join("f")).unwrap();
    // Same name and size, other content (the file system may well reuse the inode).
    write_complete(dir, "f", b"two\n");
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(lines(&p2.chunks), ["two"]);
    fs::remove_file(dir.join("f")).unwrap();
    write_complete(dir, "f", b"three\n");
    let p3 = source.poll(&p2.mark).unwrap();
    assert_eq!(lines(&p3.chunks), ["three"]);
    assert_eq!(p3.position, "3 files, 14 bytes taken");

    // What a reused inode looks like when the size matches too: the same
    // inode and size, other first bytes. (Here made by rewriting in place,
    // which the writers' protocol forbids: the file system cannot be made to
    // reuse an inode on demand.) The head hash tells it from the file taken.
    let f = dir.join("f");
    fs::write(dir.join("g"), b"three\n").unwrap();
    let p4 = source.poll(&p3.mark).unwrap();
    assert_eq!(lines(&p4.chunks), ["three"], "g: same size and content as f, another inode");
    let mut file = File::options().write(true).open(&f).unwrap();
    file.write_all(b"THREE\n").unwrap();
    drop(file);
    let p5 = source.poll(&p4.mark).unwrap();
    assert_eq!(lines(&p5.chunks), ["THREE"]);
    assert_eq!(paths(&p5.chunks), [path_str(&f)]);
}

/// A directory to stream (`in`) and one beside it on the same file system
/// (`out`), to move files out of the stream and back, inode and bytes kept.
fn in_and_out() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, out) = (tmp.path().join("in"), tmp.path().join("out"));
    fs::create_dir(&dir).unwrap();
    fs::create_dir(&out).unwrap();
    (tmp, dir, out)
}

/// A file written in place (`cp file dir/`), taken half-written, is seen
/// again longer: reported by name, and only its new bytes are taken, so
/// every line is trained once. (It was taken whole again, unreported.)
#[test]
fn dir_a_file_written_in_place_is_reported_and_its_new_bytes_taken_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = dir.join("part-0.libsvm");
    let name = path_str(&path);
    let mut source = dir_source(dir, 1 << 20);
    append(&path, b"0 1:1\n1 1:2\n0 1:");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(p1.chunks, [Chunk { path: name.clone(), start: 0, end: 16 }]);
    append(&path, b"3\n1 1:4\n");
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(p2.chunks, [Chunk { path: name.clone(), start: 16, end: 24 }], "only the new bytes");
    assert_eq!(
        p2.problems,
        [format!(
            "{name}: written in place (it grew from 16 to 24 bytes after it was taken; a file must be \
             complete when it is renamed in): only bytes 16..24 are taken now, and a line cut at byte 16 \
             may have been trained cut"
        )]
    );
    assert_eq!(p2.position, "1 file, 24 bytes taken");
    // Read now, the two polls' chunks hold every line once.
    assert_eq!(lines(&[p1.chunks, p2.chunks.clone()].concat()), ["0 1:1", "1 1:2", "0 1:3", "1 1:4"]);
    let p3 = source.poll(&p2.mark).unwrap();
    assert!(p3.chunks.is_empty() && p3.problems.is_empty(), "{p3:?}");
    assert_eq!(p3.mark, p2.mark, "the file is held as it is now");
    assert_eq!(dir_source(dir, 1 << 20).poll(&p1.mark).unwrap(), p2, "a restarted master agrees");

    // Past the 4 KiB its identity hashes: the same.
    let big = dir.join("big");
    let line = "1 1:1\n".repeat(1000);
    append(&big, line.as_bytes());
    let p4 = source.poll(&p3.mark).unwrap();
    assert_eq!(p4.chunks, [Chunk { path: path_str(&big), start: 0, end: 6000 }]);
    append(&big, b"0 1:2\n");
    let p5 = source.poll(&p4.mark).unwrap();
    assert_eq!(p5.chunks, [Chunk { path: path_str(&big), start: 6000, end: 6006 }]);
    assert!(p5.problems.len() == 1 && p5.problems[0].contains("written in place"), "{:?}", p5.problems);

    // Rewritten from its first byte, longer (what a new file reusing the
    // inode looks like): its first bytes differ, so it is new, taken whole.
    fs::write(&path, "2 1:1\n".repeat(5)).unwrap();
    let p6 = source.poll(&p5.mark).unwrap();
    assert_eq!(p6.chunks, [Chunk { path: name, start: 0, end: 30 }]);
    assert!(p6.problems.is_empty(), "{:?}", p6.problems);
}

#[test]
fn dir_a_file_missed_by_one_poll_is_not_taken_again() {
    let (_tmp, dir, out) = in_and_out();
    let mut source = dir_source(&dir, 100);
    write_complete(&dir, "a", b"a\n");
    write_complete(&dir, "b", b"b\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&p1.chunks).len(), 2);

    // What a listing racing with a rename may see: `a` under neither name.
    // One poll misses it...
    fs::rename(dir.join("a"), out.join("a")).unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(p2.chunks, vec![]);
    assert_ne!(p2.mark, p1.mark, "the mark says that `a` was missed");
    assert_eq!(p2.mark.0.len(), p1.mark.0.len(), "and still holds it");
    // ...the next finds it again: the file taken, not new data.
    fs::rename(out.join("a"), dir.join("a")).unwrap();
    let p3 = source.poll(&p2.mark).unwrap();
    assert_eq!(p3.chunks, vec![], "{p3:?}");
    assert_eq!(p3.mark, p1.mark, "present again, as before");
    assert_eq!(dir_source(&dir, 100).poll(&p2.mark).unwrap(), p3, "a restarted master agrees");
    assert_eq!(p3.position, "2 files, 4 bytes taken");
}

#[test]
fn dir_forgets_a_file_missing_from_two_polls_and_takes_it_again_when_put_back() {
    let (_tmp, dir, out) = in_and_out();
    let mut source = dir_source(&dir, 100);
    write_complete(&dir, "a", b"a1\na2\n");
    write_complete(&dir, "b", b"b\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&p1.chunks).len(), 3);

    // Deleted from the directory (a second link kept outside, to put the
    // very same file back later: same inode, size and bytes).
    fs::hard_link(dir.join("a"), out.join("a")).unwrap();
    fs::remove_file(dir.join("a")).unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    let p3 = source.poll(&p2.mark).unwrap();
    assert_eq!((p2.chunks.len(), p3.chunks.len()), (0, 0));
    assert!(p2.problems.is_empty() && p3.problems.is_empty());
    assert_eq!(p1.mark.0.len() - p3.mark.0.len(), 24, "missing from two polls: forgotten");
    assert_eq!(source.poll(&p3.mark).unwrap().mark, p3.mark, "and it stays forgotten");

    // Put back: new data to the mark that forgot it (the documented
    // choice), taken whole again; not to the one that missed it once.
    fs::hard_link(out.join("a"), dir.join("a")).unwrap();
    let p4 = source.poll(&p3.mark).unwrap();
    assert_eq!(lines(&p4.chunks), ["a1", "a2"]);
    assert_eq!(p4.position, "3 files, 14 bytes taken");
    assert_eq!(p4.mark.0.len(), p1.mark.0.len());
    assert_eq!(dir_source(&dir, 100).poll(&p2.mark).unwrap().chunks, vec![]);
}

#[test]
fn dir_a_file_renamed_within_the_directory_is_never_taken_again() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 100);
    write_complete(dir, "a", b"a\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&p1.chunks), ["a"]);
    // Under names that are not data's (like a file being written's) for
    // many polls, then under a data name again.
    let mut mark = p1.mark.clone();
    let mut at = dir.join("a");
    for name in [".a.done", ".a.done", "a.tmp", "a.tmp", "a.tmp", "z", ".a.done", "a"] {
        fs::rename(&at, dir.join(name)).unwrap();
        at = dir.join(name);
        let polled = source.poll(&mark).unwrap();
        assert_eq!(polled.chunks, vec![], "renamed {name}");
        assert_eq!(polled.mark, p1.mark, "renamed {name}: present, never missed");
        mark = polled.mark;
    }
}

#[test]
fn dir_a_file_deleted_after_it_was_taken_fails_only_its_own_chunks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 3);
    let a = write_complete(dir, "a", b"a1\na2\n");
    write_complete(dir, "b", b"b1\nb2\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    fs::remove_file(&a).unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    let p3 = source.poll(&p2.mark).unwrap();
    for p in [&p2, &p3] {
        assert!(p.chunks.is_empty() && p.problems.is_empty() && !p.closed, "{p:?}");
        assert_eq!(p.position, "2 files, 12 bytes taken");
    }
    // The chunks handed out before: `a`'s fail naming it (the master's
    // accounting fails their tasks), `b`'s read.
    let (of_a, of_b): (Vec<Chunk>, Vec<Chunk>) = p1.chunks.into_iter().partition(|c| c.path == a);
    assert_eq!(of_a.len(), 2);
    for chunk in &of_a {
        let err = read_chunk_lines(chunk).unwrap_err();
        assert!(err.to_string().contains(&a), "{err}");
    }
    assert_eq!(lines(&of_b), ["b1", "b2"]);
}

#[test]
fn dir_a_file_taken_then_made_unreadable_is_held_not_forgotten() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 100);
    let a = write_complete(dir, "a", b"a\n");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    fs::set_permissions(&a, fs::Permissions::from_mode(0o000)).unwrap();
    if File::open(&a).is_ok() {
        return; // root reads it anyway
    }
    let mut mark = p1.mark.clone();
    for i in 0..3 {
        let polled = source.poll(&mark).unwrap();
        assert_eq!(polled.chunks, vec![]);
        assert_eq!(polled.problems.len(), usize::from(i == 0), "reported once: {:?}", polled.problems);
        assert_eq!(polled.mark, p1.mark, "held by inode and size");
        mark = polled.mark;
    }
    fs::set_permissions(&a, fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(source.poll(&mark).unwrap().chunks, vec![]);
}

#[test]
fn dir_mark_holds_the_files_present_not_every_file_taken() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 1 << 20);
    let mut mark = SourceMark::default();
    let mut largest = 0;
    // A file a poll, each deleted three polls later: the mark never holds
    // more than the three present and the one missed once.
    for i in 0..200 {
        write_complete(dir, &format!("part-{i:04}"), format!("record {i}\n").as_bytes());
        if i >= 3 {
            fs::remove_file(dir.join(format!("part-{:04}", i - 3))).unwrap();
        }
        let polled = source.poll(&mark).unwrap();
        assert_eq!(polled.chunks.len(), 1);
        mark = polled.mark;
        largest = largest.max(mark.0.len());
        if i >= 4 {
            assert_eq!(mark.0.len() / 24, 4, "poll {i}: 24 bytes a file remembered, and a few more");
        }
    }
    assert!(largest < 5 * 24, "{largest} bytes");
    assert!(source.poll(&mark).unwrap().position.starts_with("200 files, "));
}

#[test]
fn dir_empty_files_are_taken_without_chunks_and_big_files_are_split() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut source = dir_source(dir, 4);
    write_complete(dir, "empty", b"");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(p1.chunks, vec![]);
    assert_eq!(p1.position, "1 file, 0 bytes taken", "taken, recorded in the mark");
    assert_ne!(p1.mark, SourceMark::default());

    let ten = write_complete(dir, "ten", b"0123\n5678\n");
    let p2 = source.poll(&p1.mark).unwrap();
    let ranges: Vec<(u64, u64)> = p2.chunks.iter().map(|c| (c.start, c.end)).collect();
    assert_eq!(ranges, [(0, 4), (4, 8), (8, 10)]);
    assert_eq!(paths(&p2.chunks), [ten]);
    assert_eq!(lines(&p2.chunks), ["0123", "5678"]);
    assert_eq!(p2.position, "2 files, 10 bytes taken");
}

#[test]
fn dir_non_utf8_names_are_a_problem_reported_once() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let bad = dir.join(OsStr::from_bytes(b"bad-\xff"));
    if fs::write(&bad, b"x\n").is_err() {
        return; // a file system that refuses such names
    }
    write_complete(dir, "good", b"g\n");
    let mut source = dir_source(dir, 100);
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(lines(&p1.chunks), ["g"]);
    assert_eq!(p1.problems.len(), 1, "{:?}", p1.problems);
    assert!(p1.problems[0].contains("bad-") && p1.problems[0].contains("UTF-8"), "{:?}", p1.problems);
    let p2 = source.poll(&p1.mark).unwrap();
    assert!(p2.problems.is_empty() && p2.chunks.is_empty(), "{p2:?}");
}

#[test]
fn dir_errors_name_the_directory_and_refuse_foreign_marks() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope");
    let err = dir_source(&missing, 100).poll(&SourceMark::default()).unwrap_err();
    assert!(err.to_string().contains(&path_str(&missing)), "{err}");

    let err = dir_source(tmp.path(), 0).poll(&SourceMark::default()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");

    let file = tmp.path().join("f");
    fs::write(&file, b"a\n").unwrap();
    let file_mark =
        FileSource::new(FileSourceOptions::new(&file, 10)).poll(&SourceMark::default()).unwrap().mark;
    let err = dir_source(tmp.path(), 100).poll(&file_mark).unwrap_err();
    assert!(err.to_string().contains("not one it returned"), "{err}");
    let err = dir_source(tmp.path(), 100).poll(&SourceMark(vec![1, 2, 3, 4, 5])).unwrap_err();
    assert!(err.to_string().contains(&path_str(tmp.path())), "{err}");
}

// ---------------------------------------------------------------------------
// FileSource

fn file_source(path: &Path, chunk_bytes: u64) -> FileSource {
    FileSource::new(FileSourceOptions::new(path, chunk_bytes))
}

#[test]
fn file_takes_whole_lines_and_a_partial_line_waits_for_its_newline() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("log.libsvm");
    let name = path_str(&path);
    let mut source = file_source(&path, 1 << 20);
    assert_eq!(source.describe(), format!("file {name:?}"));

    append(&path, b"a\nbb");
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(p1.chunks, [Chunk { path: name.clone(), start: 0, end: 2 }]);
    assert_eq!(lines(&p1.chunks), ["a"]);
    assert_eq!(p1.position, "byte 2 of 4");
    assert!(!p1.closed && p1.problems.is_empty());

    let still = source.poll(&p1.mark).unwrap();
    assert_eq!(still.chunks, vec![], "the partial line waits");
    assert_eq!(still.mark, p1.mark);

    append(&path, b"b\ncc\nd");
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(p2.chunks, [Chunk { path: name.clone(), start: 2, end: 9 }]);
    assert_eq!(lines(&p2.chunks), ["bbb", "cc"]);
    assert_eq!(p2.position, "byte 9 of 10");

    // Replay from an old mark (a restarted master): the same data again.
    assert_eq!(source.poll(&p1.mark).unwrap(), p2);
    assert_eq!(file_source(&path, 1 << 20).poll(&p1.mark).unwrap(), p2);
    assert_eq!(
        lines(&file_source(&path, 1 << 20).poll(&SourceMark::default()).unwrap().chunks),
        ["a", "bbb", "cc"]
    );
}

#[test]
fn file_cuts_new_data_into_chunks_ending_at_a_newline() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("f");
    append(&path, b"aaaa\nbbbb\ncc");
    let polled = file_source(&path, 3).poll(&SourceMark::default()).unwrap();
    let ranges: Vec<(u64, u64)> = polled.chunks.iter().map(|c| (c.start, c.end)).collect();
    assert_eq!(ranges, [(0, 3), (3, 6), (6, 9), (9, 10)]);
    assert_eq!(lines(&polled.chunks), ["aaaa", "bbbb"]);
}

#[test]
fn file_truncated_replaced_rewritten_or_gone_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("log");
    let name = path_str(&path);
    let setup = || {
        let _ = fs::remove_file(&path);
        append(&path, b"first\nsecond\n");
        let polled = file_source(&path, 100).poll(&SourceMark::default()).unwrap();
        assert_eq!(lines(&polled.chunks), ["first", "second"]);
        polled.mark
    };
    let err_of = |mark: &SourceMark| file_source(&path, 100).poll(mark).unwrap_err().to_string();

    let mark = setup();
    File::options().write(true).open(&path).unwrap().set_len(6).unwrap();
    let err = err_of(&mark);
    assert!(err.contains(&name) && err.contains("truncated to 6 bytes") && err.contains("byte 13"), "{err}");

    let mark = setup();
    let other = tmp.path().join(".log.new");
    fs::write(&other, b"first\nsecond\nthird\n").unwrap();
    fs::rename(&other, &path).unwrap();
    let err = err_of(&mark);
    assert!(err.contains(&name) && err.contains("replaced") && err.contains("byte 13"), "{err}");

    let mark = setup();
    File::options().write(true).open(&path).unwrap().set_len(0).unwrap();
    append(&path, b"FIRST\nsecond\nthird\n");
    let err = err_of(&mark);
    assert!(err.contains(&name) && err.contains("rewritten") && err.contains("byte 13"), "{err}");

    let mark = setup();
    fs::remove_file(&path).unwrap();
    let err = err_of(&mark);
    assert!(err.contains(&name) && err.contains("gone") && err.contains("byte 13"), "{err}");
    assert!(matches!(file_source(&path, 100).poll(&mark), Err(Error::Source(_))));
}

#[test]
fn file_that_does_not_exist_yet_is_waited_for() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("later");
    let mut source = file_source(&path, 100);
    let p0 = source.poll(&SourceMark::default()).unwrap();
    assert_eq!(
        p0,
        Polled { position: format!("waiting for {}", path_str(&path)), ..Polled::default() },
        "nothing, not an error"
    );
    // A first partial line pins nothing: the file may still be replaced.
    append(&path, b"par");
    let p1 = source.poll(&p0.mark).unwrap();
    assert_eq!((p1.chunks.len(), p1.mark.clone()), (0, SourceMark::default()));
    let tmp_file = tmp.path().join(".later.tmp");
    fs::write(&tmp_file, b"whole\n").unwrap();
    fs::rename(&tmp_file, &path).unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(lines(&p2.chunks), ["whole"]);
}

#[test]
fn file_close_with_and_without_a_trailing_newline() {
    let tmp = tempfile::tempdir().unwrap();

    let path = tmp.path().join("clean");
    append(&path, b"a\n");
    let mut source = file_source(&path, 100);
    let p1 = source.poll(&SourceMark::default()).unwrap();
    append(&path, b"b\n");
    fs::write(tmp.path().join("clean.closed"), b"").unwrap();
    let p2 = source.poll(&p1.mark).unwrap();
    assert!(p2.closed && p2.problems.is_empty(), "{p2:?}");
    assert_eq!(lines(&p2.chunks), ["b"]);
    // Closed is final: later appends and a removed marker change nothing.
    append(&path, b"c\n");
    fs::remove_file(tmp.path().join("clean.closed")).unwrap();
    let p3 = source.poll(&p2.mark).unwrap();
    assert!(p3.closed && p3.chunks.is_empty() && p3.mark == p2.mark, "{p3:?}");

    let path = tmp.path().join("ragged");
    let options = FileSourceOptions::new(&path, 100);
    assert_eq!(options.closed_marker, tmp.path().join("ragged.closed"));
    append(&path, b"a\nbc");
    fs::write(&options.closed_marker, b"").unwrap();
    let polled = FileSource::new(options).poll(&SourceMark::default()).unwrap();
    assert!(polled.closed);
    assert_eq!(lines(&polled.chunks), ["a"]);
    assert_eq!(
        polled.problems,
        [format!("{}: the last line (bytes 2..4) has no newline at the close; not trained", path_str(&path))]
    );

    let never = tmp.path().join("never");
    fs::write(tmp.path().join("never.closed"), b"").unwrap();
    let polled = file_source(&never, 100).poll(&SourceMark::default()).unwrap();
    assert!(polled.closed && polled.chunks.is_empty());
    assert!(polled.problems.len() == 1 && polled.problems[0].contains(&path_str(&never)), "{polled:?}");
}

/// A close from outside ([`TaskSource::close`], the master's close key) is
/// the marker's close: the same chunks, mark and problems, from a source
/// that never sees the marker. Both kinds, and a mark already taken.
#[test]
fn a_close_from_outside_is_the_markers_close() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("ragged");
    append(&path, b"a\n");
    let p1 = file_source(&path, 100).poll(&SourceMark::default()).unwrap();
    append(&path, b"b\ncd");
    let closed = file_source(&path, 100).close(&p1.mark).unwrap();
    assert!(closed.closed);
    assert_eq!(lines(&closed.chunks), ["b"]);
    assert_eq!(
        closed.problems,
        [format!("{}: the last line (bytes 4..6) has no newline at the close; not trained", path_str(&path))]
    );
    fs::write(tmp.path().join("ragged.closed"), b"").unwrap();
    assert_eq!(file_source(&path, 100).poll(&p1.mark).unwrap(), closed, "as the marker closes it");
    assert!(file_source(&path, 100).poll(&closed.mark).unwrap().chunks.is_empty(), "closed is final");
    // Before the file appeared: closed, nothing trained, said so.
    let never = tmp.path().join("never");
    let polled = file_source(&never, 100).close(&SourceMark::default()).unwrap();
    assert!(polled.closed && polled.chunks.is_empty());
    assert!(polled.problems.len() == 1 && polled.problems[0].contains(&path_str(&never)), "{polled:?}");

    let dir = tmp.path().join("in");
    fs::create_dir(&dir).unwrap();
    write_complete(&dir, "x", b"x\n");
    let p1 = dir_source(&dir, 100).poll(&SourceMark::default()).unwrap();
    write_complete(&dir, "y", b"y\n");
    fs::write(dir.join("v.tmp"), b"half").unwrap();
    let closed = dir_source(&dir, 100).close(&p1.mark).unwrap();
    assert!(closed.closed);
    assert_eq!(lines(&closed.chunks), ["y"]);
    assert_eq!(
        closed.problems,
        [format!(
            "{}: never completed (still named like a file being written); not trained",
            path_str(&dir.join("v.tmp"))
        )]
    );
    fs::write(dir.join("_CLOSED"), b"").unwrap();
    assert_eq!(dir_source(&dir, 100).poll(&p1.mark).unwrap(), closed, "as the marker closes it");
}

// ---------------------------------------------------------------------------
// GlobSource

#[test]
fn glob_gives_everything_then_nothing_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_complete(tmp.path(), "part-0", b"a\nb\n");
    let b = write_complete(tmp.path(), "part-1", b"c\n");
    let pattern = format!("{}/part-*", tmp.path().display());
    let mut source = GlobSource::new(&pattern, 3);
    assert_eq!(source.describe(), format!("glob {pattern:?}"));
    let p1 = source.poll(&SourceMark::default()).unwrap();
    assert!(p1.closed);
    assert_eq!(lines(&p1.chunks), ["a", "b", "c"]);
    assert_cover_exactly(&p1.chunks, &[(a, 4), (b, 2)]);
    assert_eq!(p1.position, "2 files, 6 bytes");
    write_complete(tmp.path(), "part-2", b"d\n");
    let p2 = source.poll(&p1.mark).unwrap();
    assert_eq!(
        p2,
        Polled { mark: p1.mark.clone(), closed: true, position: p1.position.clone(), ..Polled::default() }
    );

    let none = format!("{}/nothing-*", tmp.path().display());
    let err = GlobSource::new(&none, 3).poll(&SourceMark::default()).unwrap_err();
    assert!(matches!(err, Error::NoMatch { .. }) && err.to_string().contains(&none), "{err}");
    let dir_mark = dir_source(tmp.path(), 3).poll(&SourceMark::default()).unwrap().mark;
    assert!(GlobSource::new(&pattern, 3).poll(&dir_mark).is_err());
}

// ---------------------------------------------------------------------------
// The file source under random appends, polls and restarts

#[derive(Clone, Debug)]
enum Op {
    /// Appends these pieces (whole lines, partial lines, newlines alone).
    Append(Vec<&'static str>),
    /// Polls from the last mark, as the master does.
    Poll,
    /// A restarted master: a new source, back to an earlier mark (what came
    /// after it was never journaled).
    Restart(prop::sample::Index),
}

fn op() -> impl Strategy<Value = Op> {
    let piece = prop_oneof![Just("a"), Just("bcd"), Just("\n"), Just("é"), Just(" 1:0.5"), Just("x\n")];
    prop_oneof![
        3 => prop::collection::vec(piece, 0..8).prop_map(Op::Append),
        3 => Just(Op::Poll),
        1 => any::<prop::sample::Index>().prop_map(Op::Restart),
    ]
}

/// The complete lines of `bytes` (each ended by a newline), in order.
fn complete_lines(bytes: &[u8]) -> Vec<String> {
    let end = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&bytes[..end]).unwrap();
    text.split_terminator('\n').map(str::to_string).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn file_source_hands_out_every_complete_line_once(
        ops in prop::collection::vec(op(), 0..40),
        chunk_bytes in 1u64..24,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let path: PathBuf = tmp.path().join("stream");
        let options = FileSourceOptions::new(&path, chunk_bytes);
        let mut source = FileSource::new(options.clone());
        // marks[i] is the mark before step i; taken[i] what poll(marks[i]) returned.
        let mut marks = vec![SourceMark::default()];
        let mut taken: Vec<Vec<Chunk>> = Vec::new();
        let mut written = Vec::new();
        for op in ops {
            match op {
                Op::Append(pieces) => {
                    let bytes = pieces.concat().into_bytes();
                    append(&path, &bytes);
                    written.extend(bytes);
                }
                Op::Poll => {
                    let mark = marks.last().unwrap().clone();
                    let polled = source.poll(&mark).unwrap();
                    prop_assert!(!polled.closed && polled.problems.is_empty(), "{:?}", polled);
                    prop_assert_eq!(&source.poll(&mark).unwrap(), &polled, "same mark, same data");
                    taken.push(polled.chunks);
                    marks.push(polled.mark);
                }
                Op::Restart(i) => {
                    let k = i.index(marks.len());
                    marks.truncate(k + 1);
                    taken.truncate(k);
                    source = FileSource::new(options.clone());
                }
            }
        }
        let existed = path.exists();
        fs::write(&options.closed_marker, b"").unwrap();
        let last = source.poll(marks.last().unwrap()).unwrap();
        prop_assert!(last.closed);
        let full = written.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if !existed {
            prop_assert_eq!(last.problems.len(), 1);
        } else if full < written.len() {
            let want = format!(
                "{}: the last line (bytes {}..{}) has no newline at the close; not trained",
                path.display(), full, written.len()
            );
            prop_assert_eq!(&last.problems, &vec![want]);
        } else {
            prop_assert!(last.problems.is_empty(), "{:?}", last.problems);
        }
        taken.push(last.chunks);
        let again = FileSource::new(options.clone()).poll(&last.mark).unwrap();
        prop_assert!(again.closed && again.chunks.is_empty());

        let all: Vec<Chunk> = taken.concat();
        prop_assert!(all.iter().all(|c| c.end - c.start <= chunk_bytes));
        let mut at = 0;
        for c in &all {
            prop_assert_eq!(c.start, at, "in order, no gap, no overlap");
            at = c.end;
        }
        prop_assert_eq!(at, full as u64, "up to just after the last newline");
        prop_assert_eq!(lines(&all), complete_lines(&written));
    }
}

// ---------------------------------------------------------------------------
// The directory source under random arrivals, renames, deletions, polls and restarts

#[derive(Clone, Debug)]
enum DirOp {
    /// A new file renamed into place.
    New,
    /// A file in the directory moved out of it (inode and bytes kept).
    MoveOut(prop::sample::Index),
    /// A file moved out, put back under its name.
    MoveIn(prop::sample::Index),
    /// A file in the directory renamed within it, to a hidden name or not.
    Rename(prop::sample::Index, bool),
    /// A file in the directory deleted for good.
    Delete(prop::sample::Index),
    Poll,
    /// A restarted master, back to an earlier mark.
    Restart(prop::sample::Index),
}

fn dir_op() -> impl Strategy<Value = DirOp> {
    use prop::sample::Index;
    prop_oneof![
        3 => Just(DirOp::New),
        1 => any::<Index>().prop_map(DirOp::MoveOut),
        1 => any::<Index>().prop_map(DirOp::MoveIn),
        1 => (any::<Index>(), any::<bool>()).prop_map(|(i, hidden)| DirOp::Rename(i, hidden)),
        1 => any::<Index>().prop_map(DirOp::Delete),
        4 => Just(DirOp::Poll),
        1 => any::<Index>().prop_map(DirOp::Restart),
    ]
}

/// Where a file of the model is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    In,
    Out,
    Deleted,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The model of the documented rules: a file in the directory under a
    /// data name is taken unless the mark remembers it; the mark remembers
    /// the files in the directory (under any name) and, once more, those
    /// the last poll missed.
    #[test]
    fn dir_source_takes_a_file_again_only_after_two_polls_without_it(
        ops in prop::collection::vec(dir_op(), 0..48),
    ) {
        let (_tmp, dir, out) = in_and_out();
        let mut source = dir_source(&dir, 1 << 20);
        // Files by number: name, place, size (all sizes differ).
        let mut files: Vec<(String, Place, u64)> = Vec::new();
        let mut renames = 0;
        // marks[i] and remembered[i] (file -> missed by the last poll), taken[i]: after i polls.
        let mut marks = vec![SourceMark::default()];
        let mut remembered = vec![BTreeMap::<usize, bool>::new()];
        let mut taken = vec![0u64];
        let pick = |files: &[(String, Place, u64)], place: Place, i: &prop::sample::Index| {
            let of: Vec<usize> = (0..files.len()).filter(|&f| files[f].1 == place).collect();
            (!of.is_empty()).then(|| of[i.index(of.len())])
        };
        for op in ops {
            match op {
                DirOp::New => {
                    let n = files.len();
                    let name = format!("f{n}");
                    let body = format!("file {n} {}\n", "x".repeat(n));
                    write_complete(&dir, &name, body.as_bytes());
                    files.push((name, Place::In, body.len() as u64));
                }
                DirOp::MoveOut(i) => if let Some(f) = pick(&files, Place::In, &i) {
                    fs::rename(dir.join(&files[f].0), out.join(&files[f].0)).unwrap();
                    files[f].1 = Place::Out;
                },
                DirOp::MoveIn(i) => if let Some(f) = pick(&files, Place::Out, &i) {
                    fs::rename(out.join(&files[f].0), dir.join(&files[f].0)).unwrap();
                    files[f].1 = Place::In;
                },
                DirOp::Rename(i, hidden) => if let Some(f) = pick(&files, Place::In, &i) {
                    renames += 1;
                    let name = if hidden { format!(".f{f}-{renames}") } else { format!("f{f}-{renames}") };
                    fs::rename(dir.join(&files[f].0), dir.join(&name)).unwrap();
                    files[f].0 = name;
                },
                DirOp::Delete(i) => if let Some(f) = pick(&files, Place::In, &i) {
                    fs::remove_file(dir.join(&files[f].0)).unwrap();
                    files[f].1 = Place::Deleted;
                },
                DirOp::Poll => {
                    let mark = marks.last().unwrap().clone();
                    let polled = source.poll(&mark).unwrap();
                    prop_assert!(!polled.closed && polled.problems.is_empty(), "{:?}", polled);
                    prop_assert_eq!(&dir_source(&dir, 1 << 20).poll(&mark).unwrap(), &polled, "restart");

                    let was = remembered.last().unwrap();
                    let mut now = BTreeMap::new();
                    let mut want = Vec::new();
                    for (f, (name, place, _)) in files.iter().enumerate() {
                        if *place != Place::In {
                            continue;
                        }
                        // Present: remembered, whatever its name; or new,
                        // and taken if its name is data's.
                        if was.contains_key(&f) {
                            now.insert(f, false);
                        } else if !name.starts_with('.') {
                            now.insert(f, false);
                            want.push(path_str(&dir.join(name)));
                        }
                    }
                    for (&f, &missed) in was {
                        if !now.contains_key(&f) && !missed {
                            now.insert(f, true);
                        }
                    }
                    let mut got = paths(&polled.chunks);
                    got.sort();
                    want.sort();
                    prop_assert_eq!(got, want);
                    prop_assert_eq!(polled.mark.0.len() / 24, now.len(), "24 bytes a file remembered");
                    let count = taken.last().unwrap() + polled.chunks.len() as u64;
                    prop_assert!(polled.position.starts_with(&format!("{count} file")), "{}", polled.position);
                    marks.push(polled.mark);
                    remembered.push(now);
                    taken.push(count);
                }
                DirOp::Restart(i) => {
                    let k = i.index(marks.len());
                    marks.truncate(k + 1);
                    remembered.truncate(k + 1);
                    taken.truncate(k + 1);
                    source = dir_source(&dir, 1 << 20);
                }
            }
        }
    }
}
