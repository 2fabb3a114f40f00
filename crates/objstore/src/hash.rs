//! Chained block hashes (TokenLake-style): the key of block i is a hash of block i-1's key and
//! block i's tokens, so a key names a whole prefix and equal prefixes share keys.
//!
//! The mixer is a 64x64->128 folded multiply over two tokens at a time, in two lanes: a few ns
//! per block of 16 tokens. Keys are stored in slot headers, so the scheme is part of the pool
//! format: changing it needs a new format version (pools of another scheme are refused).
//!
//! Keys are 64 bits. By accident, for a pool of 10^6 blocks the chance of any collision is
//! ~3e-8; a collision serves another prefix's KV. On purpose it is cheap: this is a fast
//! non-cryptographic mix with public constants (the key-space seed is not secret either), so
//! whoever chooses tokens finds two blocks with one key by a birthday search of ~2^32 hashes
//! (minutes on one machine), and the mix was never analysed against chosen input, so
//! assume cheaper ways, even a block matching a given key, exist. It is no security boundary:
//! a tuttid client gains nothing it lacks, since it can store any bytes under a prompt's real
//! tokens (and write any LBA: docs/tuttid.md, "The IOMMU trust boundary"); but an engine
//! whose end users choose prompt text and must not affect each other's outputs needs a keyed
//! or wider hash (a new format version; the slot header has room). See docs/objstore.md.

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;
const MULTIPLIER: u64 = 0xD6E8_FEB8_6659_FD93;
const LANE: u64 = 0xA076_1D64_78BD_642F;

#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// The key of a block given its predecessor's key (0 for the first block) and its tokens.
/// Never 0, so 0 can mean "no block" on disk.
///
/// The tokens are mixed in two independent lanes of two tokens per step, seeded by constants
/// (4 steps per lane for 16 tokens), and the predecessor enters only in the final fold, with
/// both lanes. So the chain from one block's key to the next is a single multiply: the lanes
/// of consecutive blocks overlap in the CPU, which halved `block_keys` per block against the
/// first scheme (format version 1), where the predecessor seeded both lanes.
#[inline]
pub fn chain_hash(previous: u64, tokens: &[u32]) -> u64 {
    let mut a = fold(SEED, MULTIPLIER ^ tokens.len() as u64);
    let mut b = fold(MULTIPLIER, SEED ^ LANE);
    let mut quads = tokens.chunks_exact(4);
    for quad in &mut quads {
        a = fold(a ^ (u64::from(quad[0]) | u64::from(quad[1]) << 32), MULTIPLIER);
        b = fold(b ^ (u64::from(quad[2]) | u64::from(quad[3]) << 32), LANE);
    }
    for (i, &token) in quads.remainder().iter().enumerate() {
        a = fold(a ^ (u64::from(token) | (i as u64 + 1) << 32), MULTIPLIER);
    }
    let key = fold(a ^ previous ^ LANE, b ^ previous.rotate_left(32) ^ SEED);
    if key == 0 {
        1
    } else {
        key
    }
}

/// Keys of every full block of `tokens` (a partial last block has no key: it is not stored).
/// With `block_tokens` 0 no block is full: `out` is left empty.
pub fn block_keys(tokens: &[u32], block_tokens: u32, out: &mut Vec<u64>) {
    block_keys_seeded(0, tokens, block_tokens, out);
}

/// Keys of every full block of `tokens` in the key space `seed`: the chain starts from `seed`
/// instead of 0, so the same tokens under another seed (tuttid's model fingerprint and
/// tensor-parallel rank/world size) give unrelated keys, and a lookup in one space never finds a
/// block stored in another. Seed 0 is the in-process store's space ([`block_keys`]). With
/// `block_tokens` 0 no block is full: `out` is left empty (the block size may come from an
/// untrusted request, so it is no panic).
pub fn block_keys_seeded(seed: u64, tokens: &[u32], block_tokens: u32, out: &mut Vec<u64>) {
    out.clear();
    if block_tokens == 0 {
        return;
    }
    let mut previous = seed;
    for block in tokens.chunks_exact(block_tokens as usize) {
        previous = chain_hash(previous, block);
        out.push(previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_the_whole_prefix() {
        // Goal: equal prefixes give equal keys; a change in block 0 changes every later key; the
        // same tokens at another position give another key.
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999;
        let (mut ka, mut kb) = (Vec::new(), Vec::new());
        block_keys(&a, 16, &mut ka);
        block_keys(&b, 16, &mut kb);
        assert_eq!(ka.len(), 4);
        assert!(ka.iter().zip(&kb).all(|(x, y)| x != y));
        let mut again = Vec::new();
        block_keys(&a[..40], 16, &mut again);
        assert_eq!(again, ka[..2]);
        let repeated = vec![5u32; 32];
        block_keys(&repeated, 16, &mut ka);
        assert_ne!(ka[0], ka[1]);
        assert_ne!(chain_hash(0, &[1, 2]), chain_hash(0, &[2, 1]));
        assert_ne!(chain_hash(0, &[1]), chain_hash(0, &[1, 0]));
        assert_ne!(chain_hash(1, &[7; 16]), chain_hash(2, &[7; 16]));
        assert_ne!(chain_hash(1 << 32, &[7; 16]), chain_hash(1, &[7; 16]));
    }

    #[test]
    fn seeded_keys_start_their_chain_from_the_seed() {
        // Goal: seed 0 is the plain chain; another seed changes every key of the same tokens,
        // and the seeded chain is chain_hash from the seed (what tuttid's key spaces rely on).
        let tokens: Vec<u32> = (0..48).collect();
        let (mut plain, mut zero, mut seeded) = (Vec::new(), Vec::new(), Vec::new());
        block_keys(&tokens, 16, &mut plain);
        block_keys_seeded(0, &tokens, 16, &mut zero);
        assert_eq!(plain, zero);
        block_keys_seeded(0xfeed, &tokens, 16, &mut seeded);
        assert_eq!(seeded[0], chain_hash(0xfeed, &tokens[..16]));
        assert!(plain.iter().zip(&seeded).all(|(a, b)| a != b));
    }

    #[test]
    fn blocks_of_zero_tokens_have_no_keys_and_no_panic() {
        // Goal: the public key functions take their block size from the caller (a tuttid
        // client's request, a geometry not yet validated); 0 tokens per block used to panic in
        // `chunks_exact(0)`. No block is full then: no keys, and what `out` held is cleared.
        let tokens: Vec<u32> = (0..32).collect();
        let mut keys = vec![7, 8];
        block_keys(&tokens, 0, &mut keys);
        assert!(keys.is_empty(), "{keys:?}");
        keys.push(9);
        block_keys_seeded(0xfeed, &tokens, 0, &mut keys);
        assert!(keys.is_empty(), "{keys:?}");
        block_keys_seeded(0xfeed, &[], 0, &mut keys);
        assert!(keys.is_empty(), "{keys:?}");
    }

    const GOLDEN_FIRST: u64 = 0x1b0e_9a34_61a6_1443;
    const GOLDEN_SECOND: u64 = 0x4095_b39c_6fcc_c925;

    #[test]
    fn the_scheme_is_pinned_by_the_format_version() {
        // Goal: keys are on disk; a change to the mixer must fail here and come with a new
        // FORMAT_VERSION (these values belong to versions 2 and 3: version 3 changed only the
        // slot headers).
        assert_eq!(crate::format::FORMAT_VERSION, 3);
        let tokens: Vec<u32> = (0..16).collect();
        let first = chain_hash(0, &tokens);
        let second = chain_hash(first, &tokens);
        assert_eq!((first, second), (GOLDEN_FIRST, GOLDEN_SECOND), "{first:#x} {second:#x}");
    }
}
