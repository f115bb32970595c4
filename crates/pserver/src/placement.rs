//! Placement: which pserver shard holds which block of which parameter.
//!
//! Client and servers compute the same placement from the same inputs, so
//! they agree without talking; [`Placement::fingerprint`] lets them check.

use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BTreeSet;

use crate::block::BlockId;
use crate::error::{Error, Result};
use crate::rng::Fnv64;
use crate::sparse::TableSpec;
use crate::spec::{validate_specs, ParamSpec};

/// Where one block lives and which elements of its parameter it covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockInfo {
    /// The block.
    pub id: BlockId,
    /// First element of the parameter covered by the block.
    pub offset: usize,
    /// Number of elements (`block_size`, the last block of a parameter may be shorter).
    pub len: usize,
    /// The shard holding it. This is a shard index, not an address: when
    /// shards get replicas, a shard maps to several pservers.
    pub server: u32,
}

/// The deterministic assignment of parameter blocks to `servers` shards.
///
/// Each parameter is cut into `ceil(len / block_size)` blocks. Blocks are
/// then taken largest first (ties by [`BlockId`]) and each goes to the shard
/// with the fewest elements so far (ties to the lowest index), so loads differ
/// by at most one block.
///
/// **Small blocks share a shard.** A block of fewer than `block_size /`
/// [`SMALL_BLOCK_DIVISOR`] elements (under 1,024 floats with the default
/// blocks of 65,536: a bias, a small layer, a model of a few hundred
/// weights) goes to the least loaded shard that holds blocks already and
/// stays within `block_size` elements with it, and only where there is
/// none, to the least loaded shard. Every shard a step touches costs a
/// call (a round trip to its pserver, batched per pserver), which a few
/// KiB do not pay for: spread one block per shard, a model of two small
/// parameters made two calls a step to two pservers, where it now makes
/// one. Loads still differ by at most one block, and a placement whose
/// blocks are all larger is the same as without the rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    specs: Vec<ParamSpec>,
    servers: u32,
    block_size: usize,
    /// All blocks in `BlockId` order.
    blocks: Vec<BlockInfo>,
    /// `first[p]` is the index in `blocks` of parameter `p`'s first block; `first[params]` = `blocks.len()`.
    first: Vec<usize>,
    /// Indices into `blocks` for each shard, in `BlockId` order.
    by_server: Vec<Vec<usize>>,
    /// Elements held by each shard.
    loads: Vec<usize>,
    /// Sparse tables: their rows go to shard `row_shard(name, id, servers)`.
    tables: Vec<TableSpec>,
    /// Each table's name hashed, so a row's shard costs no string hash.
    table_hashes: Vec<u64>,
    fingerprint: u64,
}

/// Blocks of fewer than `block_size / SMALL_BLOCK_DIVISOR` elements are
/// small: they share a shard with others (see [`Placement`]).
pub const SMALL_BLOCK_DIVISOR: usize = 64;

/// Whether a block of `len` elements is small among blocks of `block_size`.
fn is_small(len: usize, block_size: usize) -> bool {
    len.saturating_mul(SMALL_BLOCK_DIVISOR) < block_size
}

impl Placement {
    /// Place `specs` on `servers` shards in blocks of at most `block_size` elements.
    ///
    /// Errors: `servers == 0`, `block_size == 0`, invalid specs, or more
    /// parameters or blocks per parameter than fit in a `u32`.
    pub fn new(specs: &[ParamSpec], servers: u32, block_size: usize) -> Result<Self> {
        if servers == 0 {
            return Err(Error::NoServers);
        }
        if block_size == 0 {
            return Err(Error::ZeroBlockSize);
        }
        validate_specs(specs)?;
        let max = u64::from(u32::MAX);
        let mut blocks = Vec::new();
        let mut first = Vec::with_capacity(specs.len() + 1);
        for (p, spec) in specs.iter().enumerate() {
            let len = spec.len();
            let n = len.div_ceil(block_size);
            let (Ok(param), true) = (u32::try_from(p), n as u64 <= max) else {
                return Err(Error::TooManyBlocks {
                    name: spec.name.clone(),
                    blocks: n,
                    params: specs.len(),
                    max,
                });
            };
            first.push(blocks.len());
            for b in 0..n {
                let offset = b * block_size;
                blocks.push(BlockInfo {
                    id: BlockId::new(param, b as u32),
                    offset,
                    len: block_size.min(len - offset),
                    server: 0,
                });
            }
        }
        first.push(blocks.len());

        // Largest first, then by id (blocks are already in id order, and the
        // sort is stable).
        let mut order: Vec<usize> = (0..blocks.len()).collect();
        order.sort_by_key(|&i| Reverse(blocks[i].len));
        // Every shard by (load, index): the least loaded is the first; the
        // least loaded that holds blocks, the first from load 1 on.
        let mut by_load: BTreeSet<(usize, u32)> = (0..servers).map(|s| (0, s)).collect();
        let mut loads = vec![0usize; servers as usize];
        for i in order {
            let len = blocks[i].len;
            // A small block shares a shard that holds blocks already, while
            // that shard stays within one block's worth; any other block,
            // or one that fits nowhere, goes to the least loaded shard.
            let shared = by_load
                .range((1, 0)..)
                .next()
                .filter(|&&(load, _)| is_small(len, block_size) && load + len <= block_size);
            // The set holds one entry per shard (`servers >= 1`), so the
            // fallback to shard 0 is never taken.
            let s = shared.or_else(|| by_load.first()).map_or(0, |&(_, s)| s);
            let load = &mut loads[s as usize];
            by_load.remove(&(*load, s));
            *load = load.saturating_add(len);
            by_load.insert((*load, s));
            blocks[i].server = s;
        }
        let mut by_server = vec![Vec::new(); servers as usize];
        for (i, b) in blocks.iter().enumerate() {
            by_server[b.server as usize].push(i);
        }

        let mut h = Fnv64::new();
        h.write_u64(specs.len() as u64);
        for s in specs {
            h.write_u64(s.name.len() as u64);
            h.write(s.name.as_bytes());
            h.write_u64(s.shape.len() as u64);
            for &d in &s.shape {
                h.write_u64(d as u64);
            }
        }
        h.write_u64(u64::from(servers));
        h.write_u64(block_size as u64);
        for b in &blocks {
            h.write_u64(u64::from(b.id.param));
            h.write_u64(u64::from(b.id.block));
            h.write_u64(b.offset as u64);
            h.write_u64(b.len as u64);
            h.write_u64(u64::from(b.server));
        }

        Ok(Self {
            specs: specs.to_vec(),
            servers,
            block_size,
            blocks,
            first,
            by_server,
            loads,
            tables: Vec::new(),
            table_hashes: Vec::new(),
            fingerprint: h.finish(),
        })
    }

    /// This placement with sparse tables beside its dense blocks. A row of
    /// table `t` lives on shard [`row_shard`](crate::sparse::row_shard)`(name, id, servers)` and
    /// replicates and moves with that shard. The tables' names, dims,
    /// initialisers and row policies join the fingerprint (they must agree
    /// on every pserver and trainer).
    ///
    /// Errors: an invalid table spec, two tables of one name, more tables
    /// than fit in a `u32`.
    pub fn with_tables(mut self, tables: Vec<TableSpec>) -> Result<Self> {
        let mut names = std::collections::BTreeSet::new();
        for table in &tables {
            table.validate()?;
            if !names.insert(table.name.as_str()) {
                return Err(Error::DuplicateTable { name: table.name.clone() });
            }
        }
        if u32::try_from(tables.len()).is_err() {
            return Err(Error::DuplicateTable { name: format!("{} tables", tables.len()) });
        }
        if tables.is_empty() {
            // A model without tables keeps its fingerprint (and its checkpoints).
            self.tables = tables;
            return Ok(self);
        }
        let mut h = Fnv64::new();
        h.write_u64(self.fingerprint);
        h.write_u64(tables.len() as u64);
        for table in &tables {
            // Name, dim, initialiser and policy all count (every process
            // runs the same build, so the debug form is the same).
            let text = format!("{table:?}");
            h.write_u64(text.len() as u64);
            h.write(text.as_bytes());
        }
        self.fingerprint = h.finish();
        self.table_hashes = tables.iter().map(|t| crate::hash_str(&t.name)).collect();
        self.tables = tables;
        Ok(self)
    }

    /// The sparse tables, in the order pushes and pulls number them.
    pub fn tables(&self) -> &[TableSpec] {
        &self.tables
    }

    /// The shard holding row `id` of table `table` (an index into
    /// [`tables`](Self::tables)); `None` for a table that does not exist.
    pub fn row_shard(&self, table: u32, id: u64) -> Option<u32> {
        let hashed = *self.table_hashes.get(table as usize)?;
        Some(crate::sparse::row_shard_hashed(hashed, id, self.servers))
    }

    /// Every block, in [`BlockId`] order.
    pub fn blocks(&self) -> &[BlockInfo] {
        &self.blocks
    }

    /// One block, if it exists.
    pub fn block(&self, id: BlockId) -> Option<&BlockInfo> {
        let p = id.param as usize;
        let start = *self.first.get(p)?;
        let end = *self.first.get(p + 1)?;
        let i = start.checked_add(id.block as usize)?;
        if i < end {
            self.blocks.get(i)
        } else {
            None
        }
    }

    /// The blocks of parameter `param`, in order (they tile the parameter).
    pub fn blocks_of(&self, param: u32) -> &[BlockInfo] {
        let p = param as usize;
        match (self.first.get(p), self.first.get(p + 1)) {
            (Some(&s), Some(&e)) => &self.blocks[s..e],
            _ => &[],
        }
    }

    /// The blocks held by shard `server`, in [`BlockId`] order (none if out of range).
    pub fn blocks_on(&self, server: u32) -> impl Iterator<Item = &BlockInfo> {
        self.by_server.get(server as usize).into_iter().flatten().map(move |&i| &self.blocks[i])
    }

    /// Number of elements held by shard `server` (0 if out of range).
    pub fn load(&self, server: u32) -> usize {
        self.loads.get(server as usize).copied().unwrap_or(0)
    }

    /// Number of shards.
    pub fn servers(&self) -> u32 {
        self.servers
    }

    /// Maximum block length.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The parameter specs placed.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// FNV-1a hash of the spec names and shapes, the server count, the block
    /// size and the whole assignment. Client and server compare it to detect
    /// that they were configured differently. Initialisers are not included.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Init;

    fn specs(lens: &[usize]) -> Vec<ParamSpec> {
        lens.iter().enumerate().map(|(i, &l)| ParamSpec::new(format!("p{i}"), vec![l], Init::Zeros)).collect()
    }

    #[test]
    fn rejects_bad_arguments() {
        let s = specs(&[4]);
        assert!(matches!(Placement::new(&s, 0, 2), Err(Error::NoServers)));
        assert!(matches!(Placement::new(&s, 1, 0), Err(Error::ZeroBlockSize)));
        assert!(matches!(Placement::new(&[], 1, 2), Err(Error::NoParams)));
    }

    #[test]
    fn worked_example() {
        // p0: 10 elements -> blocks 4,4,2 ; p1: 3 elements -> block 3 ; p2: 1.
        let p = Placement::new(&specs(&[10, 3, 1]), 2, 4).unwrap();
        let got: Vec<(u32, u32, usize, usize, u32)> =
            p.blocks().iter().map(|b| (b.id.param, b.id.block, b.offset, b.len, b.server)).collect();
        // Order: (0.0,4)->s0, (0.1,4)->s1, (1.0,3)->s0 (4 vs 4 tie -> 0),
        // (0.2,2)->s1 (7 vs 4), (2.0,1)->s1 (7 vs 6).
        assert_eq!(
            got,
            vec![(0, 0, 0, 4, 0), (0, 1, 4, 4, 1), (0, 2, 8, 2, 1), (1, 0, 0, 3, 0), (2, 0, 0, 1, 1),]
        );
        assert_eq!(p.load(0), 7);
        assert_eq!(p.load(1), 7);
        assert_eq!(p.load(5), 0);
        let on1: Vec<BlockId> = p.blocks_on(1).map(|b| b.id).collect();
        assert_eq!(on1, vec![BlockId::new(0, 1), BlockId::new(0, 2), BlockId::new(2, 0)]);
        assert_eq!(p.blocks_on(9).count(), 0);
        assert_eq!(p.block(BlockId::new(0, 2)).map(|b| b.offset), Some(8));
        assert_eq!(p.block(BlockId::new(0, 3)), None);
        assert_eq!(p.block(BlockId::new(3, 0)), None);
        assert_eq!(p.blocks_of(0).len(), 3);
        assert_eq!(p.blocks_of(7).len(), 0);
        assert_eq!(BlockId::new(3, 1).to_string(), "3.1");
    }

    #[test]
    fn small_blocks_share_a_shard() {
        // a1a's softmax model: 246 weights and 2 biases, in the default
        // blocks, over 64 shards: one shard, so one call a step.
        let p = Placement::new(&specs(&[246, 2]), 64, 1 << 16).unwrap();
        assert_eq!(p.blocks().iter().map(|b| b.server).collect::<Vec<_>>(), vec![0, 0]);
        assert_eq!(p.load(0), 248);

        // Small blocks fill a shard up to one block's worth, then the next:
        // 200 parameters of 50 in blocks of 6,400 are 10,000 elements over
        // two shards (128 parameters, then 72), none alone.
        let p = Placement::new(&specs(&[50; 200]), 8, 6400).unwrap();
        let loads: Vec<usize> = (0..8).map(|s| p.load(s)).collect();
        assert_eq!(loads, vec![6400, 3600, 0, 0, 0, 0, 0, 0]);

        // A small block goes with a partial block, not with a full one:
        // 100 -> s0 (full), 70 -> s1, 1 -> s1 (71 of 100; s0 would pass 100).
        let p = Placement::new(&specs(&[170, 1]), 4, 100).unwrap();
        let got: Vec<(u32, u32, u32)> =
            p.blocks().iter().map(|b| (b.id.param, b.id.block, b.server)).collect();
        assert_eq!(got, vec![(0, 0, 0), (0, 1, 1), (1, 0, 1)]);

        // Blocks that are not small spread as before: 246 and 2 in blocks
        // of 128 (2 is not under 128 / 64) take three shards.
        let p = Placement::new(&specs(&[246, 2]), 8, 128).unwrap();
        assert_eq!(p.blocks().iter().map(|b| b.server).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn fingerprint_changes_with_inputs() {
        let s = specs(&[10, 3]);
        let a = Placement::new(&s, 2, 4).unwrap();
        assert_eq!(a.fingerprint(), Placement::new(&s, 2, 4).unwrap().fingerprint());
        assert_ne!(a.fingerprint(), Placement::new(&s, 3, 4).unwrap().fingerprint());
        assert_ne!(a.fingerprint(), Placement::new(&s, 2, 5).unwrap().fingerprint());
        assert_ne!(a.fingerprint(), Placement::new(&specs(&[10, 4]), 2, 4).unwrap().fingerprint());
        let mut renamed = s.clone();
        renamed[1].name = "other".into();
        assert_ne!(a.fingerprint(), Placement::new(&renamed, 2, 4).unwrap().fingerprint());
        let mut reshaped = s.clone();
        reshaped[0].shape = vec![2, 5];
        assert_ne!(a.fingerprint(), Placement::new(&reshaped, 2, 4).unwrap().fingerprint());
    }
}
