//! Checkpoints through the public API (a store's snapshot saved, the file
//! loaded into a store): exact round trips, fallback past
//! corrupt, truncated and foreign files, temp-file cleanup, pruning, and a
//! property test that no single-byte corruption ever loads wrong data.

use std::fs;
use std::path::{Path, PathBuf};

use oar_pserver::checkpoint::{load_file, CheckpointDir, CheckpointInfo, LoadedCheckpoint, TMP_STALE};
use oar_pserver::{
    Adam, BlockId, Error, Init, Mode, Momentum, Optimizer, ParamSpec, ParamStore, Placement, Push,
    PushOutcome, Sgd,
};
use proptest::prelude::*;

fn specs(lens: &[usize]) -> Vec<ParamSpec> {
    lens.iter()
        .enumerate()
        .map(|(i, &l)| ParamSpec::new(format!("p{i}"), vec![l], Init::Normal { mean: 0.0, std: 1.0 }))
        .collect()
}

fn adam() -> Box<dyn Optimizer> {
    Box::new(Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 })
}

fn store(pl: &Placement, server: u32, seed: u64, opt: Box<dyn Optimizer>, mode: Mode) -> ParamStore {
    ParamStore::new(pl, server, seed, opt, mode).unwrap()
}

/// A push for every block of `st`, gradient values from a hash of (seed, block, index).
fn push(st: &ParamStore, trainer: &str, seq: u64, seed: u64) -> Push {
    let grads = st
        .blocks()
        .map(|(id, p, _)| {
            let g = (0..p.len())
                .map(|i| {
                    let h = seed
                        .wrapping_mul(31)
                        .wrapping_add(u64::from(id.param) * 7 + u64::from(id.block) * 13);
                    ((h.wrapping_add(i as u64 * 17)) % 23) as f32 * 0.1 - 1.1
                })
                .collect::<Vec<f32>>();
            (id, g.into())
        })
        .collect();
    Push { trainer: trainer.into(), seq, step: st.step(), weight: 1.0, grads, rows: Vec::new(), origin: None }
}

/// Everything a checkpoint carries, floats as bits so the comparison is exact.
#[derive(Clone, Debug, PartialEq)]
struct Snap {
    step: u64,
    blocks: Vec<(BlockId, Vec<u32>, u64, Vec<u32>)>,
    seqs: Vec<(String, u64)>,
}

fn snap(st: &ParamStore) -> Snap {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut seqs: Vec<(String, u64)> = st.last_seqs().map(|(t, s)| (t.to_string(), s)).collect();
    seqs.sort();
    Snap {
        step: st.step(),
        blocks: st.blocks().map(|(id, p, s)| (id, bits(p), s.step, bits(&s.slots))).collect(),
        seqs,
    }
}

/// A trained Adam store of server 1 of 2, and its placement.
fn trained(pushes: u64) -> (Placement, ParamStore) {
    let pl = Placement::new(&specs(&[19, 6, 3]), 2, 8).unwrap();
    let mut st = store(&pl, 1, 7, adam(), Mode::Async);
    for k in 0..pushes {
        let t = if k % 2 == 0 { "trainer-a" } else { "trainer-b" };
        let p = push(&st, t, 10 + k, k);
        assert!(matches!(st.push(p).unwrap(), PushOutcome::Applied { .. }));
    }
    (pl, st)
}

fn flip(path: &Path, at: usize, xor: u8) {
    let mut b = fs::read(path).unwrap();
    b[at] ^= xor;
    fs::write(path, b).unwrap();
}

fn skipped_names(l: &LoadedCheckpoint) -> Vec<PathBuf> {
    l.skipped.iter().map(|(p, _)| p.clone()).collect()
}

#[test]
fn round_trip_is_exact_and_training_continues_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (pl, mut orig) = trained(5);
    let info = dir.save(&orig.snapshot().unwrap(), 3).unwrap();
    assert_eq!(info.step, 5);
    assert_eq!(PathBuf::from(&info.path), dir.file_for_step(5));
    assert_eq!(info.bytes, fs::metadata(&info.path).unwrap().len());
    assert!(info.unix_time_ms > 0);

    // A fresh store with another seed: everything must come from the file.
    let mut restored = store(&pl, 1, 999, adam(), Mode::Async);
    assert_ne!(snap(&restored), snap(&orig));
    let loaded = dir.load_latest(&mut restored).unwrap().unwrap();
    assert_eq!(loaded.info, info);
    assert!(loaded.skipped.is_empty());
    let s = snap(&restored);
    assert_eq!(s, snap(&orig));
    assert_eq!(s.step, 5);
    assert!(s.blocks.iter().all(|b| b.2 == 5 && !b.3.is_empty()), "Adam state restored");
    assert_eq!(s.seqs, vec![("trainer-a".to_string(), 14), ("trainer-b".to_string(), 13)]);

    // Dedup survives: a retry of an accepted push is still a duplicate.
    assert_eq!(restored.push(push(&restored, "trainer-a", 14, 0)).unwrap(), PushOutcome::Duplicate);
    // Training goes on bit for bit the same.
    for k in 0..3 {
        let a = orig.push(push(&orig, "trainer-b", 20 + k, 100 + k)).unwrap();
        let b = restored.push(push(&restored, "trainer-b", 20 + k, 100 + k)).unwrap();
        assert_eq!(a, b);
    }
    assert_eq!(snap(&restored), snap(&orig));
    assert_eq!(restored.step(), 8);

    // load_file loads one named file the same way.
    let mut again = store(&pl, 1, 3, adam(), Mode::Async);
    assert_eq!(load_file(Path::new(&info.path), &mut again).unwrap(), info);
    assert_eq!(snap(&again).blocks, s.blocks);
}

#[test]
fn sync_store_with_momentum_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let pl = Placement::new(&specs(&[10, 4]), 1, 3).unwrap();
    let opt = || Box::new(Momentum { lr: 0.1, momentum: 0.9 });
    let mut st = store(&pl, 0, 1, opt(), Mode::Sync);
    for k in 0..3 {
        st.push(push(&st, "t", k, k)).unwrap();
    }
    st.join("u");
    st.push(push(&st, "t", 3, 3)).unwrap(); // buffered, not in the checkpoint
    let dir = CheckpointDir::new(tmp.path(), 0);
    dir.save(&st.snapshot().unwrap(), 2).unwrap();
    let mut r = store(&pl, 0, 2, opt(), Mode::Sync);
    dir.load_latest(&mut r).unwrap().unwrap();
    let (restored, live) = (snap(&r), snap(&st));
    assert_eq!((restored.step, &restored.blocks), (live.step, &live.blocks));
    // The buffered push is not in the dedup table either: its retry is taken.
    assert_eq!(restored.seqs, vec![("t".to_string(), 2)]);
    assert!(r.members().is_empty(), "membership comes from the live trainers, not the file");
    assert!(matches!(r.push(push(&r, "t", 3, 3)).unwrap(), PushOutcome::Applied { .. }));
    assert_eq!(r.step(), 4);
}

#[test]
fn no_checkpoint_is_none_and_lists_are_newest_first() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path().join("not-yet"), 1);
    let (_pl, mut st) = trained(1);
    assert_eq!(dir.list().unwrap(), Vec::<PathBuf>::new());
    assert!(dir.load_latest(&mut st).unwrap().is_none());
    assert_eq!(dir.path(), tmp.path().join("not-yet").join("shard-1"));
    assert_eq!(dir.index(), 1);
    let mut steps = Vec::new();
    for k in 0..3 {
        st.push(push(&st, "x", k, k)).unwrap();
        steps.push(dir.save(&st.snapshot().unwrap(), 5).unwrap().step);
    }
    fs::write(dir.path().join("notes.txt"), b"not a checkpoint").unwrap();
    fs::write(dir.path().join("ckpt-12x.oarckpt"), b"not a checkpoint either").unwrap();
    let want: Vec<PathBuf> = steps.iter().rev().map(|&s| dir.file_for_step(s)).collect();
    assert_eq!(dir.list().unwrap(), want);
}

#[test]
fn a_flipped_byte_anywhere_in_the_newest_falls_back_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (pl, mut st) = trained(2);
    let older = dir.save(&st.snapshot().unwrap(), 3).unwrap();
    st.push(push(&st, "trainer-c", 1, 9)).unwrap();
    let newest = dir.save(&st.snapshot().unwrap(), 3).unwrap();
    let good = fs::read(&newest.path).unwrap();
    let n = good.len();
    // (offset, expected words in the reason)
    let cases = [
        (0, "magic"),
        (9, "format version"),
        (17, "checksum"),     // fingerprint: mismatch only if the CRC agreed
        (25, "checksum"),     // server index
        (62, "checksum"),     // optimizer name
        (n / 2, "checksum"),  // block data
        (n - 20, "checksum"), // last-seq table
        (n - 1, "checksum"),  // the CRC itself
    ];
    for (at, needle) in cases {
        fs::write(&newest.path, &good).unwrap();
        flip(Path::new(&newest.path), at, 0x40);
        let mut r = store(&pl, 1, 5, adam(), Mode::Async);
        let loaded = dir.load_latest(&mut r).unwrap().unwrap();
        assert_eq!(loaded.info, older, "byte {at}");
        assert_eq!(skipped_names(&loaded), vec![PathBuf::from(&newest.path)]);
        let why = &loaded.skipped[0].1;
        assert!(why.contains("corrupt") && why.contains(needle), "byte {at}: {why}");
        assert_eq!(r.step(), older.step);
    }
}

#[test]
fn a_truncated_newest_falls_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (pl, mut st) = trained(2);
    let older = dir.save(&st.snapshot().unwrap(), 3).unwrap();
    let older_snap = snap(&st);
    st.push(push(&st, "trainer-c", 1, 9)).unwrap();
    let newest = dir.save(&st.snapshot().unwrap(), 3).unwrap();
    let good = fs::read(&newest.path).unwrap();
    for len in [0, 10, 70, good.len() / 2, good.len() - 4, good.len() - 1] {
        fs::write(&newest.path, &good[..len]).unwrap();
        let mut r = store(&pl, 1, 5, adam(), Mode::Async);
        let loaded = dir.load_latest(&mut r).unwrap().unwrap();
        assert_eq!(loaded.info, older, "length {len}");
        assert_eq!(snap(&r), older_snap);
        let why = &loaded.skipped[0].1;
        assert!(why.contains("corrupt"), "length {len}: {why}");
    }
    // Extra bytes appended are just as bad.
    let mut longer = good.clone();
    longer.extend_from_slice(b"junk");
    fs::write(&newest.path, &longer).unwrap();
    let mut r = store(&pl, 1, 5, adam(), Mode::Async);
    let loaded = dir.load_latest(&mut r).unwrap().unwrap();
    assert_eq!(loaded.info, older);
}

#[test]
fn every_checkpoint_corrupt_is_an_error_naming_each_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (pl, mut st) = trained(1);
    let mut paths = Vec::new();
    for k in 0..3 {
        st.push(push(&st, "x", k, k)).unwrap();
        paths.push(dir.save(&st.snapshot().unwrap(), 3).unwrap().path);
    }
    for p in &paths {
        let len = fs::metadata(p).unwrap().len() as usize;
        flip(Path::new(p), len / 3, 1);
    }
    let mut r = store(&pl, 1, 5, adam(), Mode::Async);
    let before = snap(&r);
    let err = dir.load_latest(&mut r).unwrap_err();
    let msg = err.to_string();
    match &err {
        Error::NoValidCheckpoint { dir: d, tried } => {
            assert_eq!(d, dir.path());
            let names: Vec<String> = tried.iter().map(|(p, _)| p.display().to_string()).collect();
            let newest_first: Vec<String> = paths.iter().rev().cloned().collect();
            assert_eq!(names, newest_first);
        }
        other => panic!("unexpected error {other}"),
    }
    for p in &paths {
        assert!(msg.contains(p.as_str()), "{msg}");
    }
    assert!(msg.contains("checksum mismatch"), "{msg}");
    assert_eq!(snap(&r), before, "a bad file harms nothing");
}

#[test]
fn foreign_checkpoints_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let (pl, st) = trained(2);
    let ours = CheckpointDir::new(tmp.path(), 1);
    let file = ours.save(&st.snapshot().unwrap(), 2).unwrap().path;

    // Another placement (block size) for the same server index.
    let other_pl = Placement::new(&specs(&[19, 6, 3]), 2, 7).unwrap();
    let mut other = store(&other_pl, 1, 7, adam(), Mode::Async);
    let err = ours.load_latest(&mut other).unwrap_err().to_string();
    assert!(err.contains(&file) && err.contains("placement fingerprint"), "{err}");

    // The same placement, another optimizer.
    let mut sgd = store(&pl, 1, 7, Box::new(Sgd { lr: 0.1 }), Mode::Async);
    let err = ours.load_latest(&mut sgd).unwrap_err().to_string();
    assert!(err.contains(&file) && err.contains("\"adam\"") && err.contains("\"sgd\""), "{err}");

    // Server 1's file placed in server 0's directory.
    let theirs = CheckpointDir::new(tmp.path(), 0);
    fs::create_dir_all(theirs.path()).unwrap();
    let copied = theirs.file_for_step(2);
    fs::copy(&file, &copied).unwrap();
    let mut s0 = store(&pl, 0, 7, adam(), Mode::Async);
    let before = snap(&s0);
    let err = theirs.load_latest(&mut s0).unwrap_err().to_string();
    assert!(err.contains(&copied.display().to_string()) && err.contains("written by server 1"), "{err}");
    assert_eq!(snap(&s0), before);
    let err = load_file(&copied, &mut s0).unwrap_err();
    assert!(matches!(err, Error::CheckpointMismatch { .. }), "{err}");

    // A store of another server cannot use this directory at all.
    assert!(matches!(ours.save(&s0.snapshot().unwrap(), 2), Err(Error::Config(_))));
    assert!(matches!(ours.load_latest(&mut s0), Err(Error::Config(_))));
}

#[test]
fn leftover_temp_files_are_ignored_and_removed_once_stale() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (pl, mut st) = trained(2);
    let info = dir.save(&st.snapshot().unwrap(), 2).unwrap();
    // An interrupted save of a later step: half a file under a temp name,
    // last written longer ago than any save takes.
    let leftover = dir.path().join("ckpt-00000000000000000099.oarckpt.77-0.tmp");
    let bytes = fs::read(&info.path).unwrap();
    let stale = |path: &std::path::Path| {
        let past = std::time::SystemTime::now() - TMP_STALE - std::time::Duration::from_secs(1);
        fs::File::options().write(true).open(path).unwrap().set_modified(past).unwrap();
    };
    fs::write(&leftover, &bytes[..bytes.len() / 2]).unwrap();
    stale(&leftover);
    // Another writer's save in progress: written to just now.
    let in_progress = dir.path().join("ckpt-00000000000000000100.oarckpt.78-0.tmp");
    fs::write(&in_progress, b"being written").unwrap();
    assert_eq!(dir.list().unwrap(), vec![PathBuf::from(&info.path)]);
    let mut r = store(&pl, 1, 5, adam(), Mode::Async);
    let loaded = dir.load_latest(&mut r).unwrap().unwrap();
    assert_eq!(loaded.info, info);
    assert!(loaded.skipped.is_empty());
    assert!(!leftover.exists(), "removed by load");
    assert!(in_progress.exists(), "a recent temp file is left to its writer");
    // Save removes them too.
    fs::write(&leftover, b"x").unwrap();
    stale(&leftover);
    st.push(push(&st, "q", 1, 1)).unwrap();
    dir.save(&st.snapshot().unwrap(), 2).unwrap();
    assert!(!leftover.exists(), "removed by save");
    assert!(in_progress.exists(), "still left to its writer");
}

#[test]
fn a_writer_that_no_longer_owns_the_shard_puts_no_checkpoint_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (_pl, st) = trained(2);
    let err = dir.save_checked(&st.snapshot().unwrap(), 2, || Err("lease expired".into())).unwrap_err();
    assert!(matches!(&err, Error::CheckpointAbandoned { why, .. } if why == "lease expired"), "{err}");
    assert!(dir.list().unwrap().is_empty(), "no checkpoint in place");
    let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "and no temp file left: {left:?}");
    let info = dir.save_checked(&st.snapshot().unwrap(), 2, || Ok(())).unwrap();
    assert_eq!(dir.list().unwrap(), vec![PathBuf::from(&info.path)]);
}

#[test]
fn keep_prunes_older_checkpoints_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::new(tmp.path(), 1);
    let (_pl, mut st) = trained(0);
    assert!(
        matches!(dir.save(&st.snapshot().unwrap(), 1), Err(Error::Config(m)) if m.contains("at least 2"))
    );
    let mut infos = Vec::new();
    for k in 0..5 {
        st.push(push(&st, "x", k, k)).unwrap();
        infos.push(dir.save(&st.snapshot().unwrap(), 3).unwrap());
    }
    let steps: Vec<u64> = infos.iter().map(|i| i.step).collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
    assert_eq!(dir.list().unwrap(), vec![dir.file_for_step(5), dir.file_for_step(4), dir.file_for_step(3)]);
    // A newer file (left by an abandoned run) is not counted and not deleted,
    // and the new checkpoint is never pruned.
    fs::copy(&infos[4].path, dir.file_for_step(100)).unwrap();
    st.push(push(&st, "x", 9, 9)).unwrap();
    dir.save(&st.snapshot().unwrap(), 2).unwrap();
    assert_eq!(dir.list().unwrap(), vec![dir.file_for_step(100), dir.file_for_step(6), dir.file_for_step(5)]);
}

#[test]
fn info_records_round_trip() {
    let info = CheckpointInfo {
        path: "/ckpt/shard-0/ckpt-00000000000000000042.oarckpt".into(),
        step: 42,
        checksum: 0xdead_beef,
        bytes: 1234,
        unix_time_ms: 1_700_000_000_000,
    };
    let b = info.encode().unwrap();
    assert_eq!(CheckpointInfo::decode(&b).unwrap(), info);
    let text = info.to_string();
    assert!(text.contains("step 42") && text.contains("deadbeef") && text.contains("shard-0"), "{text}");
    assert!(matches!(CheckpointInfo::decode(&b[..b.len() - 1]), Err(Error::BadCheckpointRecord(_))));
    let mut longer = b.clone();
    longer.push(0);
    let err = CheckpointInfo::decode(&longer).unwrap_err().to_string();
    assert!(err.contains("1 unexpected bytes"), "{err}");
}

/// The strategy's store: parameter lengths, block size, servers, which one, optimizer, pushes.
fn store_case() -> impl Strategy<Value = (Vec<usize>, usize, u32, u32, u8, u64, u64)> {
    (proptest::collection::vec(1usize..20, 1..4), 1usize..9, 1u32..3, 0u32..3, 0u8..3, 0u64..4, any::<u64>())
}

fn optimizer(kind: u8) -> Box<dyn Optimizer> {
    match kind {
        0 => Box::new(Sgd { lr: 0.1 }),
        1 => Box::new(Momentum { lr: 0.1, momentum: 0.5 }),
        _ => adam(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any single corrupt byte (anywhere, any value) in the newest file or in
    /// both files never yields wrong data: the store ends up exactly as the
    /// newest, exactly as the previous, or untouched with an error.
    #[test]
    fn corruption_never_loads_wrong_data(
        (lens, block, servers, which, opt, pushes, seed) in store_case(),
        pos in any::<prop::sample::Index>(),
        pos_older in any::<prop::sample::Index>(),
        xor in 1u8..=255,
        both in any::<bool>(),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let server = which % servers;
        let pl = Placement::new(&specs(&lens), servers, block).unwrap();
        let mut st = store(&pl, server, seed, optimizer(opt), Mode::Async);
        let dir = CheckpointDir::new(tmp.path(), server);
        for k in 0..pushes {
            st.push(push(&st, &format!("t{}", k % 2), k, seed ^ k)).unwrap();
        }
        let older = dir.save(&st.snapshot().unwrap(), 2).unwrap();
        let older_snap = snap(&st);
        st.push(push(&st, "t9", 1, seed)).unwrap();
        let newest = dir.save(&st.snapshot().unwrap(), 2).unwrap();
        let newest_snap = snap(&st);

        let b = fs::read(&newest.path).unwrap();
        flip(Path::new(&newest.path), pos.index(b.len()), xor);
        if both {
            let b = fs::read(&older.path).unwrap();
            flip(Path::new(&older.path), pos_older.index(b.len()), xor);
        }
        let mut r = store(&pl, server, seed.wrapping_add(1), optimizer(opt), Mode::Async);
        let untouched = snap(&r);
        match dir.load_latest(&mut r) {
            Ok(Some(l)) => {
                let got = snap(&r);
                prop_assert!(
                    (l.info == newest && got == newest_snap) || (l.info == older && got == older_snap),
                    "loaded {:?}", l.info
                );
                // CRC32 catches every single-byte error.
                prop_assert_eq!(l.info.step, older.step);
                prop_assert!(!both);
            }
            Ok(None) => prop_assert!(false, "checkpoints exist"),
            Err(e) => {
                prop_assert!(both, "{}", e);
                prop_assert!(matches!(e, Error::NoValidCheckpoint { .. }), "{}", e);
                prop_assert_eq!(snap(&r), untouched);
            }
        }
    }
}
