//! The checkpoint directory of one pserver: file names, atomic saves,
//! pruning, and loading the newest checkpoint that verifies (see the module
//! docs of [`checkpoint`](super)).

use std::fs::{self, File};
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::codec::{self, Check, Encoder, Reject, IO_BUF};
use super::{CheckpointInfo, LoadedCheckpoint};
use crate::error::{Error, Result};
use crate::store::{ParamStore, StoreSnapshot};

/// Checkpoint file extension.
pub const EXTENSION: &str = "oarckpt";

const PREFIX: &str = "ckpt-";
const TMP_SUFFIX: &str = ".tmp";

/// A temp file untouched this long is a save that was interrupted (a
/// crash, a kill), removed by the next save or load. One written to more
/// recently may be another pserver's save in progress (a deposed primary
/// still writing, say), and is left alone.
pub const TMP_STALE: Duration = Duration::from_secs(600);

/// Makes every temp file name of this process unique.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A random tag of this process for its temp files' names: pserver
/// processes in containers often share one pid (1), and two writers of a
/// directory must not pick one name.
fn process_tag() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    static TAG: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TAG.get_or_init(|| RandomState::new().hash_one((std::process::id(), now_ms())))
}

/// Where one logical shard's checkpoints go: `<root>/shard-<index>/ckpt-<step:020>.oarckpt`,
/// written by whichever pserver is the shard's primary (so a shard's
/// checkpoints stay in one place as its primary changes).
///
/// "Newest" means the highest step in the file name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointDir {
    index: u32,
    dir: PathBuf,
}

impl CheckpointDir {
    /// The checkpoint directory of shard `index` under `root`. Nothing is
    /// created until the first save.
    pub fn new(root: impl Into<PathBuf>, index: u32) -> Self {
        Self { index, dir: root.into().join(format!("shard-{index}")) }
    }

    /// `<root>/shard-<index>`.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The shard.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The file a checkpoint of `step` is saved to.
    pub fn file_for_step(&self, step: u64) -> PathBuf {
        self.dir.join(format!("{PREFIX}{step:020}.{EXTENSION}"))
    }

    /// Write `snapshot` (see [`ParamStore::snapshot`](crate::ParamStore::snapshot))
    /// atomically (temp file, fsync, rename, fsync of the directory), then
    /// prune: keep the new checkpoint and the `keep - 1`
    /// newest ones older than it, delete older ones (files with a higher step
    /// than the new one, left by a run that restarted from an older
    /// checkpoint, are left alone). `keep` must be at least 2 so a corrupt
    /// newest file always has a fallback. A failed prune is logged, not
    /// returned: the new checkpoint is safe either way.
    ///
    /// Holds no lock: the store goes on taking pushes while a snapshot of it
    /// is written.
    pub fn save(&self, snapshot: &StoreSnapshot, keep: usize) -> Result<CheckpointInfo> {
        self.save_checked(snapshot, keep, || Ok(()))
    }

    /// [`save`](Self::save), asking `still_owner` just before the file is
    /// put in place whether this process still owns the shard: a writer
    /// that was paused past its lease while it wrote must not put a
    /// checkpoint beside the new owner's (a higher step of another
    /// history would be restored first). Its error ends the save with
    /// [`Error::CheckpointAbandoned`]; the temp file goes.
    ///
    /// Each save writes a temp file of its own (created exclusively, named
    /// by a random tag of the process and a count of its saves), so two writers in one directory never write
    /// into or rename each other's file.
    pub fn save_checked(
        &self,
        snapshot: &StoreSnapshot,
        keep: usize,
        still_owner: impl FnOnce() -> std::result::Result<(), String>,
    ) -> Result<CheckpointInfo> {
        if keep < 2 {
            return Err(Error::Config(format!(
                "checkpoints to keep must be at least 2 (so a corrupt newest one has a fallback), got {keep}"
            )));
        }
        self.check_server(snapshot.server())?;
        let encoder = Encoder::new(snapshot)?;
        let created = !self.dir.exists();
        fs::create_dir_all(&self.dir).map_err(io_err("creating directory", &self.dir))?;
        if created {
            if let Some(parent) = self.dir.parent() {
                sync_dir(parent)?;
            }
        }
        self.remove_tmp_files();

        let step = snapshot.step();
        let path = self.file_for_step(step);
        let unique = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!("{PREFIX}{step:020}.{EXTENSION}.{:016x}-{unique}{TMP_SUFFIX}", process_tag()));
        let unix_time_ms = now_ms();
        let written = write_file(&tmp, &encoder, unix_time_ms).and_then(|v| {
            still_owner().map_err(|why| Error::CheckpointAbandoned { step, why })?;
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
    /// `*.tmp` files of interrupted saves are ignored, and removed once
    /// [`TMP_STALE`] (a newer one may be another writer's save in progress).
    ///
    /// `Ok(None)` when there is no checkpoint at all;
    /// [`Error::NoValidCheckpoint`] naming every file and why when there are
    /// some but none loads. A refused file never changes the store: every
    /// rule the restore applies is checked by the verifying pass first. The
    /// one exception is a file rewritten in place between its verification
    /// and its restore: that ends the load with
    /// [`Error::CorruptCheckpoint`] saying the store is partly restored, and
    /// no older file is loaded over the mix.
    pub fn load_latest(&self, store: &mut ParamStore) -> Result<Option<LoadedCheckpoint>> {
        self.check_server(store.server())?;
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
                Err(reject @ Reject::Touched(_)) => return Err(reject.into_error(&path)),
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

    fn check_server(&self, server: u32) -> Result<()> {
        if server == self.index {
            Ok(())
        } else {
            Err(Error::Config(format!(
                "checkpoint directory {} is for pserver {}, but the store is server {}",
                self.dir.display(),
                self.index,
                server
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
                let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
                if age.is_none_or(|age| age < TMP_STALE) {
                    continue;
                }
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

fn load_path(path: &Path, store: &mut ParamStore) -> Check<CheckpointInfo> {
    // Both passes read through this one handle, so a file renamed over the
    // path meanwhile cannot change the bytes between them.
    let mut file = File::open(path).map_err(|e| Reject::Io("opening", e))?;
    let loaded = codec::load(&mut file, store)?;
    Ok(CheckpointInfo {
        path: path.display().to_string(),
        step: loaded.step,
        checksum: loaded.checksum,
        bytes: loaded.bytes,
        unix_time_ms: loaded.unix_time_ms,
    })
}

/// Write the whole checkpoint to `tmp` and fsync it; returns (CRC, size).
fn write_file(tmp: &Path, encoder: &Encoder<'_>, unix_time_ms: u64) -> Result<(u32, u64)> {
    let file = File::options().write(true).create_new(true).open(tmp).map_err(io_err("creating", tmp))?;
    let mut w = BufWriter::with_capacity(IO_BUF, file);
    let written = encoder.write(&mut w, unix_time_ms).map_err(io_err("writing", tmp))?;
    let file = w.into_inner().map_err(|e| io_err("writing", tmp)(e.into_error()))?;
    file.sync_all().map_err(io_err("syncing", tmp))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_parse_only_checkpoints() {
        assert_eq!(step_of_name("ckpt-00000000000000000042.oarckpt"), Some(42));
        assert_eq!(step_of_name("ckpt-7.oarckpt"), Some(7));
        for bad in ["ckpt-.oarckpt", "ckpt-1.oarckpt.tmp", "ckpt-+1.oarckpt", "ckpt-1oarckpt", "x-1.oarckpt"]
        {
            assert_eq!(step_of_name(bad), None, "{bad}");
        }
        assert_eq!(step_of_name("ckpt-99999999999999999999999.oarckpt"), None, "overflow");
        let dir = CheckpointDir::new("/ckpt", 3);
        let path = dir.file_for_step(42);
        assert_eq!(path, Path::new("/ckpt/shard-3/ckpt-00000000000000000042.oarckpt"));
        assert_eq!(path.file_name().and_then(|n| n.to_str()).and_then(step_of_name), Some(42));
    }
}
