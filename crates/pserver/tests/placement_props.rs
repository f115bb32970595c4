//! Property tests of the block placement.

use oar_pserver::{BlockId, Init, ParamSpec, Placement, SMALL_BLOCK_DIVISOR};
use proptest::prelude::*;

fn specs_strategy() -> impl Strategy<Value = Vec<ParamSpec>> {
    prop::collection::vec(prop::collection::vec(1usize..12, 0..3), 1..7).prop_map(|shapes| {
        shapes
            .into_iter()
            .enumerate()
            .map(|(i, shape)| ParamSpec::new(format!("p{i}"), shape, Init::Zeros))
            .collect()
    })
}

/// The placement rule by linear scans: blocks largest first (stable, so
/// ties in id order); a small block to the least loaded shard that holds
/// blocks and stays within `block_size` with it, if any; every other block
/// to the least loaded shard (ties to the lowest index). The shard of each
/// block, in id order.
fn model(specs: &[ParamSpec], servers: u32, block_size: usize) -> Vec<u32> {
    let lens: Vec<usize> = specs
        .iter()
        .flat_map(|s| {
            let len = s.len();
            (0..len.div_ceil(block_size)).map(move |b| block_size.min(len - b * block_size))
        })
        .collect();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut loads = vec![0usize; servers as usize];
    let mut out = vec![0u32; lens.len()];
    for i in order {
        let len = lens[i];
        let least = |ok: &dyn Fn(usize) -> bool| {
            (0..servers as usize).filter(|&s| ok(s)).min_by_key(|&s| (loads[s], s))
        };
        let shared = if len * SMALL_BLOCK_DIVISOR < block_size {
            least(&|s| loads[s] > 0 && loads[s] + len <= block_size)
        } else {
            None
        };
        let s = shared.or_else(|| least(&|_| true)).unwrap();
        loads[s] += len;
        out[i] = s as u32;
    }
    out
}

proptest! {
    #[test]
    fn placement_properties(specs in specs_strategy(), servers in 1u32..9, block_size in prop_oneof![1usize..40, 40usize..800]) {
        let p = Placement::new(&specs, servers, block_size).unwrap();
        prop_assert_eq!(p.servers(), servers);
        prop_assert_eq!(p.block_size(), block_size);
        prop_assert_eq!(p.specs(), &specs[..]);

        // Blocks are in strictly increasing BlockId order and found by id.
        let ids: Vec<BlockId> = p.blocks().iter().map(|b| b.id).collect();
        prop_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        for b in p.blocks() {
            prop_assert_eq!(p.block(b.id), Some(b));
            prop_assert!(b.server < servers);
            prop_assert!(b.len >= 1 && b.len <= block_size);
        }

        // Every element of every parameter is covered by exactly one block,
        // and a parameter has ceil(len / block_size) blocks.
        for (i, spec) in specs.iter().enumerate() {
            let mut covered = vec![0u32; spec.len()];
            for b in p.blocks().iter().filter(|b| b.id.param as usize == i) {
                for c in &mut covered[b.offset..b.offset + b.len] {
                    *c += 1;
                }
            }
            prop_assert!(covered.iter().all(|&c| c == 1), "param {}: {:?}", i, covered);
            prop_assert_eq!(p.blocks_of(i as u32).len(), spec.len().div_ceil(block_size));
        }

        // blocks_on partitions the blocks; loads add up.
        let mut count = 0;
        let mut loads = Vec::new();
        for s in 0..servers {
            let on: Vec<_> = p.blocks_on(s).collect();
            prop_assert!(on.iter().all(|b| b.server == s));
            prop_assert!(on.windows(2).all(|w| w[0].id < w[1].id));
            let load: usize = on.iter().map(|b| b.len).sum();
            prop_assert_eq!(load, p.load(s));
            loads.push(load);
            count += on.len();
        }
        prop_assert_eq!(count, p.blocks().len());

        // Balanced to within one block: the largest one, or, where small
        // blocks share a shard, one block's worth.
        let small = |len: usize| len * SMALL_BLOCK_DIVISOR < block_size;
        let largest = p.blocks().iter().map(|b| b.len).max().unwrap();
        let (max, min) = (*loads.iter().max().unwrap(), *loads.iter().min().unwrap());
        let bound = if p.blocks().iter().any(|b| small(b.len)) { largest.max(block_size) } else { largest };
        prop_assert!(max - min <= bound, "loads {:?}, largest block {}", loads, largest);

        // With at least as many blocks that are not small as servers,
        // nobody is idle.
        if p.blocks().iter().filter(|b| !small(b.len)).count() >= servers as usize {
            prop_assert!(loads.iter().all(|&l| l > 0), "loads {:?}", loads);
        }

        // Each block is where the rule, written out plainly, puts it.
        let servers_of: Vec<u32> = p.blocks().iter().map(|b| b.server).collect();
        prop_assert_eq!(servers_of, model(&specs, servers, block_size));

        // Deterministic.
        let again = Placement::new(&specs, servers, block_size).unwrap();
        prop_assert_eq!(again.blocks(), p.blocks());
        prop_assert_eq!(again.fingerprint(), p.fingerprint());
    }
}
