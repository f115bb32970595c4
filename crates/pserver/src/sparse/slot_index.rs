//! A sparse table's index: row id → arena slot.
//!
//! Open addressing with linear probing over 16-byte entries (the id and
//! its slot), four to a cache line, at most 3/4 full; a removal shifts the
//! entries after it back (no tombstones, so a table under eviction never
//! needs its index rebuilt). Built for the table's access pattern rather
//! than taken from `std`: an id's entry is almost always in the cache line
//! its hash points at, so [`SlotIndex::prefetch`] can bring that line in
//! ahead of the lookup, where a SwissTable's lookup reads a control group
//! and then a bucket elsewhere, neither known to the caller in advance.

use crate::rng::mix64;

/// An id and its slot, stored plus one so that a vacant entry is all
/// zeros: a new index is then zeroed memory, which the kernel hands out
/// untouched, and an index reserved for a large cap costs address space
/// only until rows arrive. (A table's slots are below its cap, at most
/// `u32::MAX`, so the sum fits.)
#[derive(Clone, Copy, Debug)]
struct Entry {
    id: u64,
    slot_plus_one: u32,
}

// SAFETY: two integers; all zeros is a valid `Entry` (the vacant one).
unsafe impl bytemuck::Zeroable for Entry {}

const VACANT: Entry = Entry { id: 0, slot_plus_one: 0 };

/// The fewest entries of an index that has any.
const MIN_ENTRIES: usize = 16;

impl Entry {
    fn vacant(&self) -> bool {
        self.slot_plus_one == 0
    }
}

/// Id → slot. Slots must be below `u32::MAX`.
#[derive(Clone, Debug, Default)]
pub(crate) struct SlotIndex {
    /// A power of two of them, or none.
    entries: Vec<Entry>,
    len: usize,
}

impl SlotIndex {
    /// Ids held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Ids it holds before it must grow: 3/4 of its entries.
    pub(crate) fn capacity(&self) -> usize {
        self.entries.len() / 4 * 3
    }

    /// Room for `ids` without growing, if the memory can be had; false
    /// (the index as it was) if not. The new entries are zeroed memory.
    pub(crate) fn try_reserve(&mut self, ids: usize) -> bool {
        if ids <= self.capacity() {
            return true;
        }
        // A power of two of at least 16 (so divisible by 4) and at least
        // 4/3 of `ids`: 3/4 of it holds `ids`.
        let Some(want) = ids.checked_add(ids.div_ceil(3)).and_then(usize::checked_next_power_of_two) else {
            return false;
        };
        let want = want.max(MIN_ENTRIES);
        match bytemuck::allocation::try_zeroed_vec(want) {
            Ok(entries) => {
                self.rehash_into(entries);
                true
            }
            Err(()) => false,
        }
    }

    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    fn home(&self, id: u64) -> usize {
        // Truncation keeps the low bits, all the mask takes.
        mix64(id) as usize & self.mask()
    }

    /// Where `id` is, or the vacant entry where it would go.
    fn find(&self, id: u64) -> (usize, bool) {
        let mask = self.mask();
        let mut i = self.home(id);
        loop {
            let e = self.entries[i];
            if e.vacant() {
                return (i, false);
            }
            if e.id == id {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of `id`.
    pub(crate) fn get(&self, id: u64) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        match self.find(id) {
            (i, true) => Some(self.entries[i].slot_plus_one - 1),
            _ => None,
        }
    }

    pub(crate) fn contains_key(&self, id: u64) -> bool {
        self.get(id).is_some()
    }

    /// Ask the CPU to bring in the cache line where `id`'s lookup starts.
    pub(crate) fn prefetch(&self, id: u64) {
        if let Some(e) = self.entries.get(self.home(id)) {
            super::prefetch(e);
        }
    }

    /// Map `id` to `slot` (below `u32::MAX`), replacing what it had.
    pub(crate) fn insert(&mut self, id: u64, slot: u32) {
        debug_assert_ne!(slot, u32::MAX);
        if self.len >= self.capacity() {
            self.grow();
        }
        let (i, held) = self.find(id);
        self.entries[i] = Entry { id, slot_plus_one: slot.saturating_add(1) };
        if !held {
            self.len += 1;
        }
    }

    /// Drop `id`, giving back its slot. The entries after it in its run
    /// move back into the gap when their probe passes it, so every run
    /// stays unbroken.
    pub(crate) fn remove(&mut self, id: u64) -> Option<u32> {
        if self.entries.is_empty() {
            return None;
        }
        let (mut hole, true) = self.find(id) else { return None };
        let slot = self.entries[hole].slot_plus_one - 1;
        let mask = self.mask();
        let mut j = (hole + 1) & mask;
        loop {
            let e = self.entries[j];
            if e.vacant() {
                break;
            }
            // `e` may fill the hole if the hole is on its probe, from its
            // home to where it is.
            let home = self.home(e.id);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.entries[hole] = e;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.entries[hole] = VACANT;
        self.len -= 1;
        Some(slot)
    }

    /// Every (id, slot), in no order.
    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.entries.iter().filter(|e| !e.vacant()).map(|e| (e.id, e.slot_plus_one - 1))
    }

    fn grow(&mut self) {
        let size = (self.entries.len() * 2).max(MIN_ENTRIES);
        // Zeroed memory, as a reservation's: vacant entries need no writes.
        self.rehash_into(bytemuck::allocation::zeroed_vec(size));
    }

    fn rehash_into(&mut self, entries: Vec<Entry>) {
        let old = std::mem::replace(&mut self.entries, entries);
        self.len = 0;
        for e in old.into_iter().filter(|e| !e.vacant()) {
            let (i, _) = self.find(e.id);
            self.entries[i] = e;
            self.len += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Get(u64),
        Reserve(usize),
    }

    /// Ids from a small range, so that inserts, removals and lookups meet,
    /// and from a few colliding homes, so that runs form and wrap.
    fn op() -> impl Strategy<Value = Op> {
        let id = prop_oneof![0u64..64, any::<u64>()];
        prop_oneof![
            8 => (id.clone(), 0u32..u32::MAX).prop_map(|(i, s)| Op::Insert(i, s)),
            5 => id.clone().prop_map(Op::Remove),
            5 => id.prop_map(Op::Get),
            1 => (0usize..300).prop_map(Op::Reserve),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        /// Random inserts, removals, lookups and reservations give
        /// what a `HashMap` gives, and the index never fills past 3/4.
        #[test]
        fn matches_a_hash_map(ops in proptest::collection::vec(op(), 1..400)) {
            let (mut index, mut model) = (SlotIndex::default(), HashMap::new());
            for op in ops {
                match op {
                    Op::Insert(id, slot) => {
                        index.insert(id, slot);
                        model.insert(id, slot);
                    }
                    Op::Remove(id) => prop_assert_eq!(index.remove(id), model.remove(&id)),
                    Op::Get(id) => prop_assert_eq!(index.get(id), model.get(&id).copied()),
                    Op::Reserve(n) => {
                        prop_assert!(index.try_reserve(model.len() + n));
                        prop_assert!(index.capacity() >= model.len() + n);
                    }
                }
                prop_assert_eq!(index.len(), model.len());
                prop_assert!(index.len() <= index.capacity());
            }
            let mut all: Vec<(u64, u32)> = index.iter().collect();
            let mut want: Vec<(u64, u32)> = model.into_iter().collect();
            all.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(all, want);
        }
    }

    /// Resident memory of this process, from `/proc/self/status`.
    #[cfg(target_os = "linux")]
    fn resident_bytes() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    }

    /// An index reserved for a large cap is zeroed memory the kernel has
    /// not handed out yet: 512 MiB of entries reserved, far less resident
    /// (other tests of this binary run alongside, hence the margin).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_reservation_is_address_space_until_used() {
        let before = resident_bytes();
        let mut index = SlotIndex::default();
        assert!(index.try_reserve(1 << 24));
        assert_eq!(index.entries.len() * std::mem::size_of::<Entry>(), 512 << 20);
        index.insert(7, 70);
        assert_eq!(index.get(7), Some(70));
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown < 128 << 20, "{grown} bytes resident after reserving 512 MiB");
    }

    /// Removals in a run that wraps past the end of the entries leave every
    /// other id findable (the backward shift across the wrap).
    #[test]
    fn removals_keep_wrapped_runs_whole() {
        let mut index = SlotIndex::default();
        assert!(index.try_reserve(12));
        let last = index.mask();
        // Ids whose home is the last entry or the first: their run wraps.
        let ids: Vec<u64> =
            (0u64..).filter(|&id| matches!(index.home(id), h if h == last || h == 0)).take(8).collect();
        for (slot, &id) in ids.iter().enumerate() {
            index.insert(id, slot as u32);
        }
        for (k, &gone) in ids.iter().enumerate() {
            assert_eq!(index.remove(gone), Some(k as u32));
            for (slot, &id) in ids.iter().enumerate().skip(k + 1) {
                assert_eq!(index.get(id), Some(slot as u32), "id {id} after removing {gone}");
            }
        }
        assert_eq!(index.len(), 0);
    }
}
