//! Key spaces: the model fingerprint and tensor-parallel (rank, world size) a session declared
//! in `Hello` select the chain of block keys it stores and looks up. The space has a seed (a
//! hash of that identity, [`KeySpace::seed`]), and a prompt's block keys are the chain keyed
//! with the pool's key secret and that seed (`objstore::hash::KeyChain::new`, then
//! `objstore::hash::block_keys` in it: every block's key is keyed, not only the first):
//! exactly the keys an in-process `KvStore` of the same pool computes after
//! `set_key_seed(seed)`. So ranks do not find each other's blocks, a change of model or TP size
//! does not serve stale KV (all spaces share one index, so two spaces' keys meet only by a
//! 64-bit accident), and no one without the pool's secret can compute a key, even from another
//! key seen (docs/objstore.md says what the keys resist).

use objstore::hash::{block_keys, space_seed, KeyChain, KeySecret};
use objstore::index::Index;
use tutti_cluster::{ClusterError, ModelSpace};

use crate::protocol::FINGERPRINT_BYTES;

/// A session's key space in one pool: the cluster tier's [`ModelSpace`] (which checks the
/// identity, one place for the whole workspace), the seed of its block-key chain, and that
/// chain in the pool (keyed with the pool's secret, which it keeps for the other ranks' spaces
/// of an all-ranks lookup). Its `Debug` prints no secret (`KeySecret`'s and `KeyChain`'s are
/// redacted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpace {
    seed: u64,
    chain: KeyChain,
    secret: KeySecret,
    model: ModelSpace,
}

impl KeySpace {
    /// Checks the declared identity ([`ModelSpace::new`]: a fingerprint that is not all zeroes,
    /// 1 ≤ world ≤ `TP_WORLD_MAX`, rank < world) and keys its space with the pool's `secret`
    /// (`objstore::Pool::key_secret`). The error is a sentence for the client.
    pub fn new(fingerprint: &[u8; FINGERPRINT_BYTES], tp_rank: u32, tp_world: u32, secret: &KeySecret) -> Result<KeySpace, String> {
        Ok(KeySpace::of(Self::model_space(fingerprint, tp_rank, tp_world)?, secret))
    }

    /// The seed of the space of this identity, without a pool: what `KvStore::set_key_seed`
    /// takes (the store keys it with its own pool's secret). Checked as in [`KeySpace::new`].
    pub fn seed_of(fingerprint: &[u8; FINGERPRINT_BYTES], tp_rank: u32, tp_world: u32) -> Result<u64, String> {
        Ok(Self::seed_of_model(&Self::model_space(fingerprint, tp_rank, tp_world)?))
    }

    fn model_space(fingerprint: &[u8; FINGERPRINT_BYTES], tp_rank: u32, tp_world: u32) -> Result<ModelSpace, String> {
        match ModelSpace::new(*fingerprint, tp_rank, tp_world) {
            Ok(model) => Ok(model),
            Err(ClusterError::InvalidSetting(reason)) => Err(reason),
            Err(other) => Err(other.to_string()),
        }
    }

    /// The key space of a checked identity in the pool whose key secret is `secret`: one
    /// keyed hash here, none per block.
    pub fn of(model: ModelSpace, secret: &KeySecret) -> KeySpace {
        let seed = Self::seed_of_model(&model);
        KeySpace { seed, chain: KeyChain::new(secret, seed), secret: *secret, model }
    }

    fn seed_of_model(model: &ModelSpace) -> u64 {
        let fingerprint = model.fingerprint();
        let mut words = [0u32; FINGERPRINT_BYTES / 4 + 2];
        for (word, bytes) in words.iter_mut().zip(fingerprint.chunks_exact(4)) {
            *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        }
        let tail = FINGERPRINT_BYTES / 4;
        words[tail] = model.tp_rank();
        words[tail + 1] = model.tp_world();
        // Under its own tag (objstore::hash::space_seed): never 0, the in-process store's
        // seed, and not derived as any block's key (no block's words hash under that tag): it
        // equals a block's key only by a 64-bit accident, or by a search of about 2^64 hashes.
        space_seed(&words)
    }

    /// The identity: model fingerprint and tensor-parallel shape.
    pub fn model(&self) -> &ModelSpace {
        &self.model
    }

    pub fn tp_rank(&self) -> u32 {
        self.model.tp_rank()
    }

    pub fn tp_world(&self) -> u32 {
        self.model.tp_world()
    }

    /// The space's seed, unkeyed: what `KvStore::set_key_seed` takes for this space (no chain
    /// by itself: the pool's secret keys it, [`KeySpace::keys`]).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The keys of `tokens`' full blocks in this space, into `keys` (cleared first):
    /// `objstore::hash::block_keys` in the chain `KeyChain::new(secret, seed)`.
    pub fn keys(&self, tokens: &[u32], block_tokens: u32, keys: &mut Vec<u64>) {
        block_keys(&self.chain, tokens, block_tokens, keys);
    }

    /// The longest prefix of `tokens` (in blocks of `block_tokens`) whose blocks are committed in
    /// `index` in this key space. `keys` is the caller's reused buffer.
    pub fn cached_prefix(&self, index: &Index, tokens: &[u32], block_tokens: u32, keys: &mut Vec<u64>) -> usize {
        self.keys(tokens, block_tokens, keys);
        index.cached_prefix(keys)
    }

    /// The longest prefix of `tokens` committed in every rank's space of this model and world
    /// size, over one `index`: [`KeySpace::all_ranks_chains`] probing `index`, then
    /// [`RankChains::run_end`] on it. The daemon runs the two halves apart, the first without
    /// the pool lock (see there).
    pub fn cached_prefix_on_all_ranks(
        &self,
        index: &Index,
        tokens: &[u32],
        first_block: usize,
        block_tokens: u32,
        chains: &mut RankChains,
    ) -> usize {
        match self.all_ranks_chains(tokens, first_block, block_tokens, chains, |keys, first| index.cached_run_end(keys, first)) {
            Some(end) => end,
            None => chains.run_end(index),
        }
    }

    /// The first half of an all-ranks lookup, the hashing, for the daemon to do without the pool
    /// lock (a block key is a SHA-256, ~130 ns a 16-token block: TP 8 over 128K tokens is 8 ms of
    /// it, which under the lock every worker's prepare, commit and lookup would wait out). It
    /// answers the longest prefix of `tokens` committed in every rank's space of this model and
    /// world size: what an engine's scheduler process needs before it plans a prefill over all
    /// ranks (a block missing on one rank must be recomputed on all of them).
    ///
    /// Each rank's chain goes into `chains`, hashed over the prefix the ranks before it shared
    /// at `probe` (`probe(keys, first_block)`: where the committed run from `first_block` ends,
    /// a brief look at the index that may change before the second half), so the cost is one
    /// chain over `tokens` plus at most `tp_world - 1` chains over the shrinking common prefix.
    /// `Some(first_block)` when a rank had nothing from there (the answer, at that probe's
    /// instant, whatever the others hold); else `None`, and [`RankChains::run_end`] under one
    /// lock gives the answer over one state of the index: the ranks' shortest run, capped at
    /// what the last rank's chain covers (shorter only where blocks were committed between the
    /// halves; each rank then still holds every block of the answer).
    ///
    /// From `first_block` (blocks the engine holds itself need not be cached): where the run of
    /// blocks from there committed on every rank ends, `first_block` when it is empty (clamped
    /// to the full blocks of `tokens`). Only each chain's keys from `first_block` are kept, and
    /// at most `RankChains::CHAIN_KEYS_MAX` of them over all the ranks (8 MiB, where a TP-1024
    /// lookup of 1-token blocks would otherwise hold 2 GiB): past that the chains are cut short
    /// and the answer may be short of what every rank holds, never past it.
    pub fn all_ranks_chains(
        &self,
        tokens: &[u32],
        first_block: usize,
        block_tokens: u32,
        chains: &mut RankChains,
        mut probe: impl FnMut(&[u64], usize) -> usize,
    ) -> Option<usize> {
        chains.keys.clear();
        chains.ends.clear();
        let full = tokens.len() / block_tokens.max(1) as usize;
        let first_block = first_block.min(full);
        chains.first_block = first_block;
        if block_tokens == 0 {
            // No block is full (objstore::hash gives no keys): nothing is cached from
            // `first_block`, and the empty chain has no keys from there to keep.
            return Some(first_block);
        }
        let mut common = full;
        let world = self.tp_world();
        for rank in 0..world {
            // This rank's chain takes at most an equal share of the keys the cap leaves for it
            // and the ranks after it, so the chains held stay under the cap whatever the world
            // and block size. A clamped chain can only lower the answer, which is safe: a lookup
            // is advisory (the engine recomputes what it is not told is cached).
            let share = chains.keys_max.saturating_sub(chains.keys.len()) / (world - rank) as usize;
            common = common.min(first_block + share);
            if common == first_block {
                return Some(first_block);
            }
            let space = match KeySpace::new(self.model.fingerprint(), rank, world, &self.secret) {
                Ok(space) => space,
                // Unreachable: every rank below a world this space was built with is valid.
                Err(_) => return Some(first_block),
            };
            // Room for exactly this chain: one grown key by key doubles, up to twice its length.
            chains.scratch.clear();
            chains.scratch.reserve_exact(common);
            space.keys(&tokens[..common * block_tokens as usize], block_tokens, &mut chains.scratch);
            // Within the chain hashed and from `first_block` whatever `probe` answers, so that
            // no slice below can fall out of range.
            common = probe(&chains.scratch, first_block).clamp(first_block, chains.scratch.len());
            // Blocks before `first_block` are the engine's own: the locked probe needs none.
            let chain = &chains.scratch[first_block..];
            // Room, reserved exactly, for what this chain and the ranks after it (each over at
            // most the prefix this probe left) can still add, within the cap: extended chain by
            // chain, `keys` would double up to twice the cap (16 MiB for 8 MiB of keys). That
            // bound only shrinks rank after rank, so this allocates at most once a lookup.
            let still = chain.len() + (world - rank - 1) as usize * (common - first_block);
            chains.keys.reserve_exact(still.min(chains.keys_max.saturating_sub(chains.keys.len())));
            chains.keys.extend_from_slice(chain);
            chains.ends.push(chains.keys.len());
        }
        (common == first_block).then_some(first_block)
    }
}

/// Every rank's block keys from the lookup's first block for an all-ranks lookup
/// ([`KeySpace::all_ranks_chains`]), kept from one lookup to the next by the connection: room
/// for at most `RankChains::CHAIN_KEYS_MAX` keys over all the ranks (reserved exactly, not
/// grown by doubling), plus room for exactly the one chain over the request's blocks being
/// hashed; [`RankChains::trim`] gives back what a large lookup grew.
#[derive(Debug)]
pub struct RankChains {
    /// Rank after rank, each from `first_block`.
    keys: Vec<u64>,
    /// Where each rank's chain ends in `keys`.
    ends: Vec<usize>,
    /// The chain being hashed, from block 0 (a key chains on the one before it).
    scratch: Vec<u64>,
    first_block: usize,
    /// `CHAIN_KEYS_MAX`, smaller in tests.
    keys_max: usize,
}

impl Default for RankChains {
    fn default() -> RankChains {
        RankChains { keys: Vec::new(), ends: Vec::new(), scratch: Vec::new(), first_block: 0, keys_max: RankChains::CHAIN_KEYS_MAX }
    }
}

impl RankChains {
    /// Keys kept between lookups at most: 1 MiB, a TP-8 lookup of 16K blocks.
    const KEEP_KEYS: usize = 1 << 17;

    /// Keys one lookup's chains hold, and have room for, at most: 8 MiB.
    const CHAIN_KEYS_MAX: usize = 1 << 20;

    #[cfg(test)]
    fn with_keys_max(keys_max: usize) -> RankChains {
        RankChains { keys_max, ..RankChains::default() }
    }

    /// The second half of an all-ranks lookup, for under the pool lock: probes only, no hashing
    /// (about 7 ns a key). Where the run from the first block committed on every rank's chain
    /// ends: the shortest one, over one state of `index`.
    pub fn run_end(&self, index: &Index) -> usize {
        let mut start = 0;
        let mut common = usize::MAX;
        for &end in &self.ends {
            common = common.min(self.first_block + index.cached_prefix(&self.keys[start..end]));
            if common == self.first_block {
                break;
            }
            start = end;
        }
        if common == usize::MAX {
            self.first_block
        } else {
            common
        }
    }

    /// Gives back memory past `RankChains::KEEP_KEYS` that a large world's lookup grew.
    pub fn trim(&mut self) {
        // Cleared first: `shrink_to` never goes below the length, and the scratch still holds
        // the last chain hashed (the next lookup clears both anyway).
        self.keys.clear();
        self.keys.shrink_to(Self::KEEP_KEYS);
        self.scratch.clear();
        self.scratch.shrink_to(Self::KEEP_KEYS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint(byte: u8) -> [u8; FINGERPRINT_BYTES] {
        [byte; FINGERPRINT_BYTES]
    }

    fn secret() -> KeySecret {
        KeySecret::from_bytes([0x4b; 32]).unwrap()
    }

    /// An in-process store over a fresh pool (one software controller, 8 engine blocks of a
    /// 2-layer model) formatted with `secret`, and its engine memory.
    fn store_with_secret(secret: KeySecret) -> (objstore::KvStore<gio_uring::CpuExecutor>, nvme_driver::DmaRegion) {
        use nvme_driver::{Controller, ControllerConfig, DataPointerMode, NamespaceId};
        use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};
        use objstore::{format_pool, FormatParams, KvLayout, KvRegistration, KvStore, ModelGeometry, Pool, PoolTarget, StoreConfig};
        let geometry = ModelGeometry { layers: 2, kv_heads: 2, head_dim: 64, dtype_bytes: 2, block_tokens: 16 };
        let config =
            EmuConfig::default().with_backing(Backing::Memory { bytes: 16 << 20 }).with_namespaces(vec![NamespaceConfig::new(512, None)]);
        let device = EmuDevice::start(config).expect("software controller");
        let backend: std::sync::Arc<dyn nvme_driver::hw::DeviceBackend> = device;
        let controller = std::sync::Arc::new(Controller::init(backend, ControllerConfig::default()).expect("bring-up"));
        let targets = vec![PoolTarget { controller: controller.clone(), namespace: NamespaceId(1) }];
        let params = FormatParams { slot_count_max: Some(16), key_secret: Some(secret), ..FormatParams::new(geometry) };
        format_pool(&targets, &params).expect("format");
        let (pool, _) = Pool::open(targets, Some(&geometry)).expect("open");
        let dma = controller.dma().clone();
        let region = dma.allocate((geometry.block_bytes() * 8) as usize).expect("engine memory");
        let layout = KvLayout::BlockMajor { base: region.iova(), block_stride_bytes: geometry.block_bytes() };
        let registration = KvRegistration::new(geometry, 8, layout, DataPointerMode::Prp).expect("registration");
        let store_config = StoreConfig::default();
        let executor = objstore::cpu_executor_for(&pool, 16, &store_config).expect("executor");
        (KvStore::new(pool, registration, dma, executor, store_config).expect("store"), region)
    }

    /// Stores `tokens`' two blocks through `store` in its current key space, committed.
    fn store_two_blocks(store: &mut objstore::KvStore<gio_uring::CpuExecutor>, tokens: &[u32]) {
        use objstore::KvRequest;
        let plan = store.prepare_store(&KvRequest { tokens, block_ids: &[0, 1] }).expect("prepare_store");
        for layer in 0..2 {
            store.store_layer(plan.handle, layer, gio_uring::SmBudget(1)).expect("store_layer");
            store.wait(plan.handle, std::time::Instant::now() + std::time::Duration::from_secs(10)).expect("wait");
        }
        store.commit_store(plan.handle).expect("commit");
    }

    #[test]
    fn the_daemons_keys_are_the_stores_keys_of_the_same_pool_and_space() {
        // Goal: tuttid computes block keys itself (lookups, prepares, cluster segments); for a
        // space of a pool they are the keys an in-process store of that pool computes after
        // `set_key_seed(space.seed())`, both keyed with the pool's secret: what the store
        // committed, the daemon's space of that pool finds, and the same space keyed with
        // another pool's secret does not. Over a pool formatted with that other secret it is
        // the reverse. (A side that forgot the secret computes the unkeyed chain and fails one
        // of these: the daemon's space would find nothing the keyed store committed, or the
        // store's commits would be found by neither keyed space.)
        let (secret_a, secret_b) = (KeySecret::from_bytes([0xa5; 32]).unwrap(), KeySecret::from_bytes([0x5b; 32]).unwrap());
        let tokens: Vec<u32> = (0..32).map(|i| i * 7 + 1).collect();
        for (own, other) in [(secret_a, secret_b), (secret_b, secret_a)] {
            let (mut store, _memory) = store_with_secret(own);
            let space = KeySpace::new(&fingerprint(21), 1, 2, &own).unwrap();
            let foreign = KeySpace::new(&fingerprint(21), 1, 2, &other).unwrap();
            assert_eq!(space.seed(), foreign.seed(), "the seed is the space's, whatever the pool");
            assert_eq!(KeySpace::seed_of(&fingerprint(21), 1, 2), Ok(space.seed()));
            store.set_key_seed(space.seed());
            store_two_blocks(&mut store, &tokens);
            assert_eq!(store.lookup(&tokens), 2);
            let mut keys = Vec::new();
            assert_eq!(space.cached_prefix(store.pool().index(), &tokens, 16, &mut keys), 2, "the daemon finds the store's blocks");
            assert_eq!(foreign.cached_prefix(store.pool().index(), &tokens, 16, &mut keys), 0, "another pool's secret finds none");
            let mut chains = RankChains::default();
            let settled =
                space.all_ranks_chains(&tokens, 0, 16, &mut chains, |keys, first| store.pool().index().cached_run_end(keys, first));
            assert_eq!(settled, Some(0), "rank 0 stored nothing");
            let mut unkeyed = Vec::new();
            block_keys(&KeyChain::new(&KeySecret::from_bytes([0x42; 32]).unwrap(), space.seed()), &tokens, 16, &mut unkeyed);
            assert_eq!(store.pool().index().cached_prefix(&unkeyed), 0, "the store keyed its chain with its own pool's secret");
        }
    }

    #[test]
    fn spaces_differ_by_model_rank_and_world() {
        // Goal: each part of the identity changes the seed; equal identities give equal seeds.
        let base = KeySpace::new(&fingerprint(1), 0, 2, &secret()).unwrap();
        assert_eq!(base, KeySpace::new(&fingerprint(1), 0, 2, &secret()).unwrap());
        let others = [
            KeySpace::new(&fingerprint(2), 0, 2, &secret()).unwrap(),
            KeySpace::new(&fingerprint(1), 1, 2, &secret()).unwrap(),
            KeySpace::new(&fingerprint(1), 0, 4, &secret()).unwrap(),
            KeySpace::new(&fingerprint(1), 0, 1, &secret()).unwrap(),
        ];
        for other in others {
            assert_ne!(other.seed(), base.seed(), "{other:?}");
            assert_ne!(other.seed(), 0);
        }
    }

    #[test]
    fn a_seed_is_not_the_key_of_a_block_of_its_own_words() {
        // Goal: a space's seed is hashed under its own tag, so it is not the in-process key
        // (seed 0) of a block made of the very words it was derived from (the fingerprint, rank
        // and world), which with a shared tag it was, by construction, for that block size.
        let fingerprint = fingerprint(3);
        let space = KeySpace::new(&fingerprint, 1, 2, &secret()).unwrap();
        let mut words: Vec<u32> = fingerprint.chunks_exact(4).map(|bytes| u32::from_le_bytes(bytes.try_into().unwrap())).collect();
        words.extend([1, 2]);
        let chain = KeyChain::new(&secret(), 0);
        assert_ne!(space.seed(), chain.block_key(0, &words));
        // The derivation before, a tag word after the others: the same block's key.
        let tagged: Vec<u32> = words.iter().copied().chain([0x7464_6b31]).collect();
        assert_ne!(space.seed(), chain.block_key(0, &tagged));
        assert_eq!(space.seed(), objstore::hash::space_seed(&words));
        assert_ne!(space.seed(), 0);
    }

    #[test]
    fn bad_identities_are_refused_in_words() {
        assert!(KeySpace::new(&[0; FINGERPRINT_BYTES], 0, 1, &secret()).unwrap_err().contains("all zeroes"));
        assert!(KeySpace::new(&fingerprint(1), 0, 0, &secret()).unwrap_err().contains("outside 1..=1024"));
        assert!(KeySpace::new(&fingerprint(1), 0, 2048, &secret()).unwrap_err().contains("outside"));
        assert!(KeySpace::new(&fingerprint(1), 2, 2, &secret()).unwrap_err().contains("rank 2 is not below the world size 2"));
    }

    #[test]
    fn a_lookup_finds_only_its_own_space() {
        // Goal: blocks committed under rank 0's keys are found by rank 0 (longest prefix), not
        // by rank 1, another world size, another model, or the in-process store's space.
        let tokens: Vec<u32> = (0..64).collect();
        let rank0 = KeySpace::new(&fingerprint(7), 0, 2, &secret()).unwrap();
        let mut index = Index::new(&[8], 1);
        let mut keys = Vec::new();
        rank0.keys(&tokens, 16, &mut keys);
        // Commit the first three of four blocks.
        for &key in &keys[..3] {
            let allocation = index.allocate_on(0).unwrap();
            index.commit(0, allocation.slot, &[key], 1);
        }
        let mut scratch = Vec::new();
        assert_eq!(rank0.cached_prefix(&index, &tokens, 16, &mut scratch), 3);
        assert_eq!(rank0.cached_prefix(&index, &tokens[..40], 16, &mut scratch), 2);
        for other in [
            KeySpace::new(&fingerprint(7), 1, 2, &secret()).unwrap(),
            KeySpace::new(&fingerprint(7), 0, 4, &secret()).unwrap(),
            KeySpace::new(&fingerprint(8), 0, 2, &secret()).unwrap(),
        ] {
            assert_eq!(other.cached_prefix(&index, &tokens, 16, &mut scratch), 0, "{other:?}");
        }
        let mut plain = Vec::new();
        block_keys(&KeyChain::new(&secret(), 0), &tokens, 16, &mut plain);
        assert_eq!(index.cached_prefix(&plain), 0, "seed 0 (in-process keys) must not see a session's blocks");
    }

    #[test]
    fn all_ranks_lookup_is_the_shortest_prefix_any_rank_has() {
        // Goal: for TP 1, 2 and 4, each rank having committed its own number of blocks (5, 7,
        // 3, 6), the scheduler's lookup answers the minimum over the ranks of this world only;
        // any rank's session (and only this model's) gets the same answer.
        let tokens: Vec<u32> = (0..128).collect();
        for world in [1u32, 2, 4] {
            let mut index = Index::new(&[64], 1);
            let committed: Vec<usize> = (0..world).map(|rank| [5, 7, 3, 6][rank as usize]).collect();
            for rank in 0..world {
                let space = KeySpace::new(&fingerprint(9), rank, world, &secret()).unwrap();
                let mut keys = Vec::new();
                space.keys(&tokens, 16, &mut keys);
                for &key in &keys[..committed[rank as usize]] {
                    let allocation = index.allocate_on(0).unwrap();
                    index.commit(0, allocation.slot, &[key], 1);
                }
            }
            // Another world size's blocks must not count: all 8 blocks for world * 2, rank 0.
            let wider = KeySpace::new(&fingerprint(9), 0, world * 2, &secret()).unwrap();
            let mut keys = Vec::new();
            wider.keys(&tokens, 16, &mut keys);
            for &key in &keys {
                let allocation = index.allocate_on(0).unwrap();
                index.commit(0, allocation.slot, &[key], 1);
            }
            let expected = *committed.iter().min().unwrap();
            let mut scratch = RankChains::default();
            for rank in 0..world {
                let space = KeySpace::new(&fingerprint(9), rank, world, &secret()).unwrap();
                assert_eq!(space.cached_prefix_on_all_ranks(&index, &tokens, 0, 16, &mut scratch), expected, "world {world} rank {rank}");
            }
            // A shorter prompt caps the answer; another model sees nothing.
            let first = KeySpace::new(&fingerprint(9), 0, world, &secret()).unwrap();
            assert_eq!(first.cached_prefix_on_all_ranks(&index, &tokens[..40], 0, 16, &mut scratch), expected.min(2));
            let other_model = KeySpace::new(&fingerprint(10), 0, world, &secret()).unwrap();
            assert_eq!(other_model.cached_prefix_on_all_ranks(&index, &tokens, 0, 16, &mut scratch), 0);
        }
    }

    /// Commits `count` blocks of `space`'s chain over `tokens` from block `from`, one slot each,
    /// and returns their slots.
    fn commit_blocks(index: &mut Index, space: &KeySpace, tokens: &[u32], from: usize, count: usize) -> Vec<u32> {
        let mut keys = Vec::new();
        space.keys(tokens, 16, &mut keys);
        let mut slots = Vec::new();
        for &key in &keys[from..from + count] {
            let allocation = index.allocate_on(0).unwrap();
            index.commit(0, allocation.slot, &[key], 1);
            slots.push(allocation.slot);
        }
        slots
    }

    #[test]
    fn all_ranks_keys_are_hashed_apart_from_the_locked_probe() {
        // Goal: the daemon hashes every rank's chain without the pool lock and under it only
        // probes: `run_end` takes the index and precomputed keys, no tokens, and gives the
        // shortest prefix any rank has, as before, for TP 1, 2, 4 and 8, whichever rank asks.
        let tokens: Vec<u32> = (0..16 * 12).collect();
        for world in [1u32, 2, 4, 8] {
            let mut index = Index::new(&[256], 1);
            let committed: Vec<usize> = (0..world as usize).map(|rank| [9, 11, 6, 12, 10, 7, 12, 8][rank]).collect();
            for rank in 0..world {
                let space = KeySpace::new(&fingerprint(4), rank, world, &secret()).unwrap();
                commit_blocks(&mut index, &space, &tokens, 0, committed[rank as usize]);
            }
            let expected = *committed.iter().min().unwrap();
            let mut chains = RankChains::default();
            for rank in 0..world {
                let space = KeySpace::new(&fingerprint(4), rank, world, &secret()).unwrap();
                let mut probes = 0;
                let settled = space.all_ranks_chains(&tokens, 0, 16, &mut chains, |keys, first| {
                    probes += 1;
                    index.cached_run_end(keys, first)
                });
                assert_eq!(settled, None, "world {world}: every rank has blocks");
                assert_eq!(probes, world, "world {world}: one brief probe a rank");
                assert_eq!(chains.run_end(&index), expected, "world {world} rank {rank}");
            }
        }
    }

    #[test]
    fn the_locked_probe_sees_the_index_as_it_is_then() {
        // Goal: blocks that leave the index between the unlocked hashing and the locked probe
        // lower the answer to what every rank holds at the probe; blocks committed in between
        // do not raise it past what the hashed chains cover (each rank still holds it all); a
        // rank with nothing settles the answer at once, with no locked probe to make.
        let tokens: Vec<u32> = (0..16 * 8).collect();
        let world = 2;
        let rank0 = KeySpace::new(&fingerprint(5), 0, world, &secret()).unwrap();
        let rank1 = KeySpace::new(&fingerprint(5), 1, world, &secret()).unwrap();
        let mut index = Index::new(&[64], 1);
        commit_blocks(&mut index, &rank0, &tokens, 0, 6);
        let rank1_slots = commit_blocks(&mut index, &rank1, &tokens, 0, 4);
        let mut chains = RankChains::default();
        fn probe(index: &Index) -> impl FnMut(&[u64], usize) -> usize + '_ {
            move |keys, first| index.cached_run_end(keys, first)
        }
        assert_eq!(rank0.all_ranks_chains(&tokens, 0, 16, &mut chains, probe(&index)), None);
        assert_eq!(chains.run_end(&index), 4);
        // Rank 1's block 2 leaves (a CRC failure) before the locked probe.
        index.condemn(0, rank1_slots[2]);
        assert_eq!(chains.run_end(&index), 2);
        // Blocks 2..8 of rank 1 and 6..8 of rank 0 arrive: rank 1's chain was hashed over the
        // 6 blocks rank 0 had at its probe, so the answer stays at 6 (both ranks hold them).
        commit_blocks(&mut index, &rank1, &tokens, 2, 6);
        commit_blocks(&mut index, &rank0, &tokens, 6, 2);
        assert_eq!(chains.run_end(&index), 6);
        // Hashed again, the whole prompt.
        assert_eq!(rank1.all_ranks_chains(&tokens, 0, 16, &mut chains, probe(&index)), None);
        assert_eq!(chains.run_end(&index), 8);
        // Another model has nothing on rank 0: settled, whatever the index holds later.
        let other = KeySpace::new(&fingerprint(6), 1, world, &secret()).unwrap();
        assert_eq!(other.all_ranks_chains(&tokens, 0, 16, &mut chains, probe(&index)), Some(0));
        assert_eq!(other.all_ranks_chains(&tokens, 3, 16, &mut chains, probe(&index)), Some(3));
    }

    #[test]
    fn all_ranks_lookup_from_a_first_block_needs_only_the_blocks_from_there() {
        // Goal: ranks that committed blocks 2..5, 2..7 and 2..4 (block 0 and 1 on none: an
        // engine holding them itself) give nothing from block 0, the shortest run's end (4)
        // from blocks 1 (nothing: block 1 is missing, so 1) and 2, the start itself past the
        // run, and the prompt's end for a start past the prompt.
        let tokens: Vec<u32> = (0..128).collect();
        let world = 3;
        let mut index = Index::new(&[64], 1);
        for (rank, end) in [5usize, 7, 4].into_iter().enumerate() {
            let space = KeySpace::new(&fingerprint(9), rank as u32, world, &secret()).unwrap();
            let mut keys = Vec::new();
            space.keys(&tokens, 16, &mut keys);
            for &key in &keys[2..end] {
                let allocation = index.allocate_on(0).unwrap();
                index.commit(0, allocation.slot, &[key], 1);
            }
        }
        let mut scratch = RankChains::default();
        let space = KeySpace::new(&fingerprint(9), 1, world, &secret()).unwrap();
        let from = |first_block, scratch: &mut RankChains| space.cached_prefix_on_all_ranks(&index, &tokens, first_block, 16, scratch);
        assert_eq!(from(0, &mut scratch), 0);
        assert_eq!(from(1, &mut scratch), 1);
        assert_eq!(from(2, &mut scratch), 4);
        assert_eq!(from(3, &mut scratch), 4);
        assert_eq!(from(5, &mut scratch), 5, "past the shortest run: nothing from there");
        assert_eq!(from(100, &mut scratch), 8, "a start past the prompt is its end");
    }

    #[test]
    fn the_chains_held_stay_under_the_cap_and_the_answer_under_the_truth() {
        // Goal: world 64 over a 200-block prompt, rank 40 holding blocks 0..120, rank 7 0..160
        // and every other rank all 200: uncapped, the answer is the truth (120) and the keys
        // held for the locked probe are only those from the first block. Capped, every rank's
        // chain is cut to an equal share of the cap (cap / 64 blocks), so the keys held stay
        // under the cap and the answer is first_block + that share where the cut falls below
        // rank 40's 120, and 120 where it falls above (past rank 7's 160 too): never past what
        // every rank holds.
        let tokens: Vec<u32> = (0..16 * 200).collect();
        let world = 64;
        let held = |rank: u32| match rank {
            40 => 120,
            7 => 160,
            _ => 200,
        };
        let mut index = Index::new(&[64 * 200], 1);
        for rank in 0..world {
            let space = KeySpace::new(&fingerprint(11), rank, world, &secret()).unwrap();
            commit_blocks(&mut index, &space, &tokens, 0, held(rank));
        }
        let space = KeySpace::new(&fingerprint(11), 5, world, &secret()).unwrap();
        let mut chains = RankChains::default();
        assert_eq!(space.cached_prefix_on_all_ranks(&index, &tokens, 0, 16, &mut chains), 120);
        assert_eq!(space.cached_prefix_on_all_ranks(&index, &tokens, 100, 16, &mut chains), 120);
        // Each chain from block 100 over the prefix the ranks before it shared: ranks 0..=7
        // over 200 blocks, 8..=40 over rank 7's 160, 41.. over rank 40's 120.
        assert_eq!(chains.keys.len(), 8 * 100 + 33 * 60 + 23 * 20, "only the keys from the first block");
        assert_eq!(space.cached_prefix_on_all_ranks(&index, &tokens, 150, 16, &mut chains), 150, "rank 40 has nothing from 150");
        // (cap, first block, answer): the share is cap / 64 blocks a rank.
        for (cap, first_block, expected) in [
            (64 * 100, 0, 100),      // cut at 100, below rank 40's 120
            (64 * 119, 0, 119),      // cut at 119, just below
            (64 * 120 + 63, 0, 120), // cut at 120, exactly rank 40's
            (64 * 140, 0, 120),      // cut at 140, above rank 40's, below rank 7's
            (64 * 180, 0, 120),      // cut at 180, above both
            (64 * 10, 100, 110),     // from block 100: cut at 110
            (64 * 30, 100, 120),     // from block 100: cut at 130, above
            (64, 0, 1),              // one block a rank
            (63, 0, 0),              // not one block a rank: nothing
        ] {
            let mut chains = RankChains::with_keys_max(cap);
            let answer = space.cached_prefix_on_all_ranks(&index, &tokens, first_block, 16, &mut chains);
            assert!(chains.keys.len() <= cap, "cap {cap}: {} keys held", chains.keys.len());
            assert_eq!(answer, expected, "cap {cap} from block {first_block}");
            assert!(answer <= 120, "cap {cap}: {answer} past what every rank holds");
        }
    }

    #[test]
    fn the_chains_allocated_stay_under_the_cap() {
        // Goal: the cap bounds the memory the chains take, not only the keys they hold: a vector
        // grown key by key or chain by chain doubles, up to twice what it holds (world 3 over
        // 100-block chains: 100, 200, then 400 for 300 keys). Every rank holding a 200-block
        // prompt, the keys' room stays within the cap and the chain being hashed within the
        // blocks it covers (first_block + cap / 3), lookup after lookup on the same buffers.
        let tokens: Vec<u32> = (0..16 * 200).collect();
        let world = 3;
        let mut index = Index::new(&[3 * 200], 1);
        for rank in 0..world {
            let space = KeySpace::new(&fingerprint(14), rank, world, &secret()).unwrap();
            commit_blocks(&mut index, &space, &tokens, 0, 200);
        }
        let space = KeySpace::new(&fingerprint(14), 2, world, &secret()).unwrap();
        for (cap, first_block) in [(300, 0), (3 * 150, 20), (3 * 190 + 2, 0), (3 * 70 + 1, 100), (1 << 20, 0)] {
            let mut chains = RankChains::with_keys_max(cap);
            for _ in 0..2 {
                let answer = space.cached_prefix_on_all_ranks(&index, &tokens, first_block, 16, &mut chains);
                assert_eq!(answer, 200.min(first_block + cap / 3), "cap {cap} from block {first_block}");
                assert!(chains.keys.capacity() <= cap, "cap {cap}: room for {} keys", chains.keys.capacity());
                let covered = 200.min(first_block + cap / 3);
                assert!(chains.scratch.capacity() <= covered, "cap {cap}: room for {} keys hashing {covered}", chains.scratch.capacity());
            }
        }
    }

    #[test]
    fn a_block_size_of_0_is_no_panic_from_a_first_block() {
        // Goal: block size 0 has no blocks (objstore::hash gives no keys, and says it is no
        // panic): an all-ranks lookup from a first block past 0 answers that start, nothing
        // cached from there, instead of slicing the empty chain from it.
        let tokens = [1u32; 64];
        let space = KeySpace::new(&fingerprint(13), 0, 2, &secret()).unwrap();
        let index = Index::new(&[8], 1);
        let mut chains = RankChains::default();
        let probe = |keys: &[u64], first| index.cached_run_end(keys, first);
        assert_eq!(space.all_ranks_chains(&tokens, 2, 0, &mut chains, probe), Some(2));
        assert_eq!(space.all_ranks_chains(&tokens, 0, 0, &mut chains, probe), Some(0));
        assert_eq!(space.cached_prefix_on_all_ranks(&index, &tokens, 2, 0, &mut chains), 2);
    }

    #[test]
    fn trim_gives_back_the_scratch_of_a_large_lookup() {
        // Goal: after a lookup over more than `KEEP_KEYS` blocks, trim leaves no buffer holding
        // more than `KEEP_KEYS` keys' room (the scratch chain included).
        let tokens: Vec<u32> = (0..RankChains::KEEP_KEYS as u32 + 1000).collect();
        let space = KeySpace::new(&fingerprint(12), 0, 1, &secret()).unwrap();
        let index = Index::new(&[8], 1);
        let mut chains = RankChains::default();
        assert_eq!(space.all_ranks_chains(&tokens, 0, 1, &mut chains, |keys, first| index.cached_run_end(keys, first)), Some(0));
        assert!(chains.scratch.capacity() > RankChains::KEEP_KEYS);
        chains.trim();
        assert!(chains.scratch.capacity() <= RankChains::KEEP_KEYS, "scratch keeps {}", chains.scratch.capacity());
        assert!(chains.keys.capacity() <= RankChains::KEEP_KEYS);
    }
}
