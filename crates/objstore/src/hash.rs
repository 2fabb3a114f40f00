//! Chained block hashes (TokenLake-style): the key of block i is a hash of block i-1's key and
//! block i's tokens, so a key names a whole prefix and equal prefixes share keys.
//!
//! A key is the first 64 bits (little-endian) of SHA-256 over an unambiguous encoding: the tag
//! `tutti-block-v1`, the predecessor's key (u64 LE), the token count (u64 LE), the tokens (u32
//! LE each); 0 is taken as 1. Keys are stored in slot headers, so the scheme is part of the
//! pool format: changing it needs a new format version (pools of another scheme are refused).
//! Version 4 introduced it; versions 1-3 used fast non-cryptographic mixes.
//!
//! Why a cryptographic hash: the seed of a key space (tuttid's model fingerprint and TP
//! rank/world) is not secret, the first store of a key wins, and whoever chooses prompt tokens
//! (an engine's end users) could, with the earlier public-constant mix, craft a block whose key
//! matches the key of a prefix others send (a shared system prompt) and have them served the
//! attacker's KV. What SHA-256 truncated to 64 bits resists, and what it does not
//! (docs/objstore.md, "Index and allocation", says the same at length):
//! - One target: a block whose key equals one given key (a second preimage of 64 bits) takes
//!   ~2^64 trials, a trial being about one SHA-256 compression (the message's first 64 bytes
//!   fixed, their midstate computed once).
//! - Many targets: an attacker content with any of T keys (every block key of predictable
//!   prefixes not yet stored, across every TP rank's key space) takes ~2^64/T: T = 2^16 is 2^48
//!   trials (hours on a GPU), T = 2^20 is 2^44.
//! - A birthday search: ~2^32 trials (minutes on one core) find two prefixes A and B with one key
//!   at some block i. The chain then runs on from equal keys, so A‖x and B‖x share the key of
//!   every later block for any x. The attacker stores A first; a victim whose prompt begins with
//!   B up to the end of block i (counted from token 0, chat template included; same model, TP
//!   rank/world and block size) gets A's KV at block i whatever follows. Searching two families
//!   (harmless-looking variants of B against variants of A) lets B read as ordinary text. So
//!   what is exposed is every prompt that begins with text the attacker wrote (a published
//!   template or system prompt, a document an application puts first), whatever follows it; a
//!   prompt whose first i+1 blocks differ from B's is not.
//! - By accident: for a pool of 10^6 blocks the chance of any collision is ~3e-8.
//!
//! A keyed hash, a secret in the seed, would remove both searches (an attacker could not
//! compute a key) at the same cost per block: the seed is hashed once per key space. Not done:
//! every node of a cluster, and every process opening a pool, must compute the same keys, so it
//! needs a secret shared cluster-wide, kept in the superblock or the daemon's configuration.
//! Widening keys to 128 bits (index, protocol, cluster registry) would raise the birthday
//! search to ~2^64 but is a larger format and protocol change, not done either.
//!
//! Keys made from an engine's own block hash (vLLM's offloading tier, SGLang's HiCache: the
//! tokens are words of SHA-256 of the engine's key, python/tutti/_engine.py `hash_tokens`) are
//! only as strong as that hash: two prompts whose engine hashes collide get one key here, so
//! with vLLM's xxhash options SHA-256 buys nothing.
//!
//! A tuttid client is no attacker to defend against here: it can store any bytes under a
//! prompt's real tokens (and write any LBA: docs/tuttid.md, "The IOMMU trust boundary").
//! Cost: ~130 ns per 16-token block in the standalone `block_keys_cost` test, ~115 ns added per
//! block to `prepare_retrieve` / `prepare_store` in the `layer_api` bench (docs/objstore.md).

use sha2::{Digest, Sha256};

/// The domain tag, first in every hashed message: a fixed length, so the fields after it are
/// at fixed offsets, and a new encoding takes a new tag (and format version).
const DOMAIN: &[u8; 14] = b"tutti-block-v1";
/// The tag of a key space's seed ([`space_seed`]), of the same length as [`DOMAIN`]: no seed
/// is derived as a block's key, whatever its tokens and block size (it equals one only by a
/// 64-bit accident or a ~2^64 search).
const SPACE_DOMAIN: &[u8; 14] = b"tutti-space-v1";
/// Tokens converted to little-endian bytes per SHA-256 update (a 256-byte stack buffer): no
/// allocation per block, and one update for the usual 16- or 32-token block.
const TOKENS_PER_UPDATE: usize = 64;

/// The key of a block given its predecessor's key (0 for the first block) and its tokens.
/// Never 0, so 0 can mean "no block" on disk.
///
/// SHA-256 of `DOMAIN`, `previous` (u64 LE), `tokens.len()` (u64 LE) and the tokens (u32 LE
/// each), hashed incrementally; the key is the digest's first 8 bytes, little-endian. With the
/// count before the tokens and every field of fixed width, no two (previous, tokens) pairs
/// share a message. 16 tokens make 94 bytes: two SHA-256 compressions.
#[inline]
pub fn chain_hash(previous: u64, tokens: &[u32]) -> u64 {
    tagged_hash(DOMAIN, previous, tokens)
}

/// The seed of a key space (tuttid's: the words of a model fingerprint, TP rank and world
/// size), for [`block_keys_seeded`]: [`chain_hash`]'s encoding under its own tag, so a seed is
/// not derived as the in-process key (seed 0) of a block made of the same words (it equals
/// one only by a 64-bit accident or a ~2^64 search). Never 0.
pub fn space_seed(words: &[u32]) -> u64 {
    tagged_hash(SPACE_DOMAIN, 0, words)
}

/// SHA-256 of `tag`, `previous` (u64 LE), the count of `tokens` (u64 LE) and the tokens (u32
/// LE each): the key of that message ([`key_of_digest`]).
#[inline]
fn tagged_hash(tag: &[u8; 14], previous: u64, tokens: &[u32]) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(tag);
    hasher.update(previous.to_le_bytes());
    hasher.update((tokens.len() as u64).to_le_bytes());
    let mut buffer = [0u8; 4 * TOKENS_PER_UPDATE];
    for run in tokens.chunks(TOKENS_PER_UPDATE) {
        for (bytes, token) in buffer.chunks_exact_mut(4).zip(run) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        hasher.update(&buffer[..4 * run.len()]);
    }
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    key_of_digest(first)
}

/// The key a digest names: its first 8 bytes, little-endian, with 0 (no block) taken as 1.
#[inline]
fn key_of_digest(first: [u8; 8]) -> u64 {
    u64::from_le_bytes(first).max(1)
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
    fn a_space_seed_is_hashed_under_its_own_tag() {
        // Goal: a key space's seed is chain_hash's encoding under the tag tutti-space-v1, so it
        // is no block's key: the same words as a first block give another value.
        let words = [7u32, 8, 9, 10, 11];
        let mut message = b"tutti-space-v1".to_vec();
        message.extend(0u64.to_le_bytes());
        message.extend((words.len() as u64).to_le_bytes());
        words.iter().for_each(|word| message.extend(word.to_le_bytes()));
        let digest = Sha256::digest(&message);
        assert_eq!(space_seed(&words), u64::from_le_bytes(digest[..8].try_into().unwrap()).max(1));
        assert_ne!(space_seed(&words), chain_hash(0, &words));
    }

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

    /// The encoding the keys are defined by, built in one buffer and hashed in one call: what
    /// `chain_hash`'s incremental, buffered feeding must agree with.
    fn reference_key(previous: u64, tokens: &[u32]) -> u64 {
        use sha2::{Digest, Sha256};
        let mut message = b"tutti-block-v1".to_vec();
        message.extend_from_slice(&previous.to_le_bytes());
        message.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        for token in tokens {
            message.extend_from_slice(&token.to_le_bytes());
        }
        let digest = Sha256::digest(&message);
        let key = u64::from_le_bytes(digest[..8].try_into().unwrap());
        key.max(1)
    }

    #[test]
    fn keys_are_the_first_64_bits_of_sha256_over_tag_previous_count_and_tokens() {
        // Goal: the key is SHA-256 (not a fast mix a chooser of tokens can steer) over an
        // unambiguous encoding: a fixed tag, the predecessor, the token count, the tokens. Block
        // sizes around the 64-token stack buffer and 64-byte SHA blocks, and an empty block.
        for len in [0usize, 1, 3, 15, 16, 17, 32, 63, 64, 65, 128, 200] {
            let tokens: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(0x9E37_79B9) ^ 0x8000_0001).collect();
            for previous in [0, 1, 0xfeed, u64::MAX] {
                assert_eq!(chain_hash(previous, &tokens), reference_key(previous, &tokens), "{len} tokens after {previous:#x}");
            }
        }
    }

    #[test]
    fn a_digest_starting_with_zero_bytes_gives_key_1() {
        // Goal: 0 stays "no block" on disk, whatever the digest.
        assert_eq!(key_of_digest([0; 8]), 1);
        assert_eq!(key_of_digest([1, 0, 0, 0, 0, 0, 0, 0]), 1);
        assert_eq!(key_of_digest([0, 1, 0, 0, 0, 0, 0, 0]), 0x100);
    }

    /// Cost of `block_keys` per block: 4096 tokens in 16-token blocks (256 blocks), the median
    /// of 15 runs of 200 chains each. A measurement, not a check: run it in release,
    /// `cargo test --release --offline -p objstore --lib hash::tests::block_keys_cost -- --ignored --nocapture`
    /// (figures in docs/objstore.md, "Index and allocation").
    #[test]
    #[ignore = "a measurement; run in release with --ignored --nocapture"]
    fn block_keys_cost() {
        let tokens: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_256).collect();
        let mut keys = Vec::with_capacity(256);
        let mut runs: Vec<f64> = (0..15)
            .map(|_| {
                let started = std::time::Instant::now();
                for _ in 0..200 {
                    block_keys(std::hint::black_box(&tokens), 16, &mut keys);
                    std::hint::black_box(&keys);
                }
                started.elapsed().as_nanos() as f64 / (200.0 * 256.0)
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        eprintln!("block_keys, 16-token blocks: median {:.1} ns/block (min {:.1}, max {:.1}, 15 runs)", runs[7], runs[0], runs[14]);
    }

    // Also computed with Python's hashlib over the same encoding.
    const GOLDEN_FIRST: u64 = 0x3c52_32ae_5104_ba42;
    const GOLDEN_SECOND: u64 = 0x3545_aca8_dd32_00bf;

    #[test]
    fn the_scheme_is_pinned_by_the_format_version() {
        // Goal: keys are on disk; a change to the scheme must fail here and come with a new
        // FORMAT_VERSION (these values belong to version 4, the first with SHA-256 keys).
        assert_eq!(crate::format::FORMAT_VERSION, 4);
        let tokens: Vec<u32> = (0..16).collect();
        let first = chain_hash(0, &tokens);
        let second = chain_hash(first, &tokens);
        assert_eq!((first, second), (GOLDEN_FIRST, GOLDEN_SECOND), "{first:#x} {second:#x}");
    }
}
