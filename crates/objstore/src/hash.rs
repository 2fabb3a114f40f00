//! Chained block hashes (TokenLake-style): the key of block i is a hash of block i-1's key and
//! block i's tokens, so a key names a whole prefix and equal prefixes share keys.
//!
//! A key is the first 64 bits (little-endian) of SHA-256 over an unambiguous encoding: the tag
//! `tutti-block-v2`, the key space's secret 16-byte space key, the predecessor's key (u64 LE),
//! the token count (u64 LE), the tokens (u32 LE each); 0 is taken as 1. Keys are stored in
//! slot headers, so the scheme is part of the pool format: changing it needs a new format
//! version (pools of another scheme are refused). Version 5 keys every block with the space
//! key of a [`KeyChain`], derived from the pool's [`KeySecret`] and the space's seed; version 4
//! hashed the same fields without the space key (tag `tutti-block-v1`), unkeyed; versions 1-3
//! used fast non-cryptographic mixes.
//!
//! Why a cryptographic, keyed hash: the seed of a key space (tuttid's model fingerprint and TP
//! rank/world) is not secret, the first store of a key wins, and whoever chooses prompt tokens
//! (an engine's end users) could, with the earlier public-constant mix, craft a block whose key
//! matches the key of a prefix others send (a shared system prompt) and have them served the
//! attacker's KV. Against whoever can compute keys, SHA-256 truncated to 64 bits resists a
//! little (docs/objstore.md, "Index and allocation", says the same at length):
//! - One target: a block whose key equals one given key (a second preimage of 64 bits) takes
//!   ~2^64 trials.
//! - Many targets: an attacker content with any of T keys (every block key of predictable
//!   prefixes not yet stored, across every TP rank's key space) takes ~2^64/T: T = 2^16 is 2^48
//!   trials (hours on a GPU), T = 2^20 is 2^44.
//! - A birthday search: ~2^32 trials (minutes on one core) find two prefixes A and B with one key
//!   at some block i. The chain then runs on from equal keys, so A‖x and B‖x share the key of
//!   every later block for any x. The attacker stores A first; a victim whose prompt begins with
//!   B up to the end of block i (counted from token 0, chat template included; same model, TP
//!   rank/world and block size) gets A's KV at block i whatever follows. So what is exposed is
//!   every prompt that begins with text the attacker wrote, whatever follows it.
//! - By accident: for a pool of 10^6 blocks the chance of any collision is ~3e-8.
//!
//! Hence keys are keyed (format version 5): each key space's [`KeyChain`] is one SHA-256 of the
//! pool's [`KeySecret`] (32 random bytes in every device's superblock, one per pool, shared by
//! every node of a cluster through a secret file) and the space's seed, and its space key is in
//! every block's message, not only the first. Without the secret (or that space's chain) no key
//! can be computed, so no search can be run: an attacker cannot tell which of its prefixes
//! collide. A key that is seen (etcd's segment names, data-plane frames, a node's segment
//! manifest are plain text) reveals nothing about any other key, its own prefix's extensions
//! included: extending a chain from a known key needs the space key too. The cost is one hash
//! per key space (when a store's seed is set, when a daemon session says Hello) and none per
//! block: the space key keeps a 16-token block's message within two SHA-256 compressions and
//! a 32-token block's within three, as without it. What remains: whoever reads the superblock
//! (the pool's devices) or the secret file, or is a tuttid client (trusted anyway, below), can
//! compute keys; and accidental collisions, as above. Widening keys to 128 bits (index,
//! protocol, cluster registry) would make the birthday search ~2^64 even for those, but is a
//! larger format and protocol change, not done.
//!
//! Keys made from an engine's own block hash (vLLM's offloading tier, SGLang's HiCache: the
//! tokens are words of SHA-256 of the engine's key, python/tutti/_engine.py `hash_tokens`) are
//! only as strong as that hash: two prompts whose engine hashes collide get one key here, so
//! with vLLM's xxhash options SHA-256 buys nothing.
//!
//! A tuttid client is no attacker to defend against here: it can store any bytes under a
//! prompt's real tokens (and write any LBA: docs/tuttid.md, "The IOMMU trust boundary").
//! Cost (measured on format 4's message, which takes as many compressions at 16 tokens): ~130 ns
//! per 16-token block in the standalone `block_keys_cost` test, ~115 ns added per block to
//! `prepare_retrieve` / `prepare_store` in the `layer_api` bench; one run of format 5's: median
//! 146.5 ns (docs/objstore.md).

use sha2::{Digest, Sha256};

use crate::error::ObjstoreError;

/// The domain tag of a block's key, first in its hashed message: a fixed length (every tag
/// here has 14 bytes), so the fields after it are at fixed offsets, and a new encoding takes a
/// new tag (and format version). `tutti-block-v1` (format 4: tag, previous, count, tokens, no
/// space key) is retired: no message of this scheme is one of that scheme's.
const DOMAIN: &[u8; 14] = b"tutti-block-v2";
/// The tag of a key space's seed ([`space_seed`]), of the same length as [`DOMAIN`]: no seed
/// is derived as a block's key, whatever its tokens and block size (it equals one only by a
/// 64-bit accident).
const SPACE_DOMAIN: &[u8; 14] = b"tutti-space-v1";
/// The tag of a key space's [`KeyChain`] (its space key and chain start), of the same length as
/// [`DOMAIN`] and [`SPACE_DOMAIN`]: the tags differ and each message starts with its tag, so no
/// message hashed under one is a message hashed under another. A chain's values are thus never
/// derived as a block's key or a space's seed (they equal one only by accident, and nobody
/// without the secret can search for one).
const KEYED_DOMAIN: &[u8; 14] = b"tutti-keyed-v1";
/// The bytes of a [`KeyChain`]'s space key, in every block's hashed message.
const SPACE_KEY_BYTES: usize = 16;
/// The bytes of a [`KeySecret`].
pub const KEY_SECRET_BYTES: usize = 32;
/// Bytes of a key secret's non-secret name ([`KeySecret::tag_bytes`]).
pub const KEY_SECRET_TAG_BYTES: usize = 4;
/// Where [`KeySecret::random`] reads: the kernel's CSPRNG, which never blocks once seeded at boot.
const RANDOM_SOURCE: &str = "/dev/urandom";
/// The bytes of a key secret file read at most: 64 hex digits and some trailing whitespace. A
/// bound, so a path naming something huge (a device, a log) is refused without reading it all.
const SECRET_FILE_BYTES_MAX: u64 = 4096;

/// Tokens converted to little-endian bytes per SHA-256 update (a 256-byte stack buffer): no
/// allocation per block, and one update for the usual 16- or 32-token block.
const TOKENS_PER_UPDATE: usize = 64;

/// The seed of a key space (tuttid's: the words of a model fingerprint, TP rank and world
/// size), for [`KeyChain::new`]: SHA-256 under its own tag of 0 (u64 LE), the word count (u64
/// LE) and the words (u32 LE each), its first 8 bytes little-endian, never 0. Not secret: the
/// pool's secret keys it in [`KeyChain::new`].
pub fn space_seed(words: &[u32]) -> u64 {
    tagged_hash(SPACE_DOMAIN, &[], 0, words)
}

/// One key space's chain of block keys in one pool: a secret 16-byte space key, hashed into
/// every block's key, and where the chain starts, both from one SHA-256 under the tag
/// `tutti-keyed-v1` of the pool's [`KeySecret`] and the space's seed ([`KeyChain::new`], the
/// only constructor). So every block key is keyed, not only the first: a key that leaks (an
/// etcd segment name, a data-plane frame, a node's manifest) lets no one compute any other key,
/// not even the keys of its own prefix's extensions.
///
/// Its `Debug` prints nothing of it (the space key is as secret as the pool's secret for this
/// space).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyChain {
    space_key: [u8; SPACE_KEY_BYTES],
    start: u64,
}

impl std::fmt::Debug for KeyChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyChain(<redacted>)")
    }
}

impl KeyChain {
    /// The chain of the space `seed` in a pool whose secret is `secret`: SHA-256 of the tag
    /// `tutti-keyed-v1`, the 32 secret bytes and `seed` (u64 LE); its first 8 bytes
    /// (little-endian, 0 taken as 1) are where the chain starts (the "previous key" of block
    /// 0), the next 16 the space key. One hash per key space, none per block.
    pub fn new(secret: &KeySecret, seed: u64) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(KEYED_DOMAIN);
        hasher.update(secret.0);
        hasher.update(seed.to_le_bytes());
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        let mut space_key = [0u8; SPACE_KEY_BYTES];
        space_key.copy_from_slice(&digest[8..8 + SPACE_KEY_BYTES]);
        KeyChain { space_key, start: key_of_digest(first) }
    }

    /// The key of a block given its predecessor's key in this chain (for block 0, the chain's
    /// start, which [`block_keys`] supplies) and its tokens. Never 0, so 0 can mean "no block"
    /// on disk.
    ///
    /// SHA-256 of the tag `tutti-block-v2`, the space key (16 bytes), `previous` (u64 LE),
    /// `tokens.len()` (u64 LE) and the tokens (u32 LE each), hashed incrementally; the key is
    /// the digest's first 8 bytes, little-endian. With the count before the tokens and every
    /// field of fixed width, no two (previous, tokens) pairs share a message. 16 tokens make
    /// 110 bytes, 119 with SHA-256's padding (at least 9 bytes): two compressions, as the
    /// unkeyed 94-byte message of format 4 took; 32 tokens make 174 bytes, three, as before.
    #[inline]
    pub fn block_key(&self, previous: u64, tokens: &[u32]) -> u64 {
        tagged_hash(DOMAIN, &self.space_key, previous, tokens)
    }
}

/// A pool's key secret: 32 bytes from which every key space's [`KeyChain`] is derived, so that
/// only who holds it (or a space's chain) can compute block keys. Stored in every
/// device's superblock (format version 5); every node of a cluster formats its pool with the
/// same one (a secret file) so their keys agree.
///
/// Its `Debug` prints no byte of it ([`KeySecret::tag`] is a non-secret name for it), and it
/// has no `Display`: anything that prints a superblock or an error prints no secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeySecret([u8; KEY_SECRET_BYTES]);

impl std::fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySecret(<redacted>)")
    }
}

/// The tag of [`KeySecret::tag`]'s hash: its own, so the printed name is no chain start or key.
const SECRET_TAG_DOMAIN: &[u8; 14] = b"tutti-sname-v1";

impl KeySecret {
    /// A secret of these bytes. All zeroes is refused: it is what a reserved (never written)
    /// field reads as, so it would mean "no secret" rather than one.
    pub fn from_bytes(bytes: [u8; KEY_SECRET_BYTES]) -> Result<Self, ObjstoreError> {
        if bytes.iter().all(|&byte| byte == 0) {
            return Err(ObjstoreError::KeySecret { reason: "all 32 bytes are zero (an unset secret)".into() });
        }
        Ok(Self(bytes))
    }

    /// A fresh secret from the operating system's random source (`/dev/urandom`).
    pub fn random() -> Result<Self, ObjstoreError> {
        let bytes = os_random().map_err(|error| ObjstoreError::KeySecretSource { path: RANDOM_SOURCE.into(), source: error })?;
        // All zeroes from a working CSPRNG has probability 2^-256: a source that gives it is broken.
        Self::from_bytes(bytes)
    }

    /// Parses a secret file's text: exactly 64 hex digits (either case), then optionally
    /// whitespace (a trailing newline). The error names what is wrong, never the text itself.
    pub fn from_hex(text: &[u8]) -> Result<Self, ObjstoreError> {
        let invalid = |reason: String| ObjstoreError::KeySecret { reason };
        let end = text.iter().rposition(|byte| !byte.is_ascii_whitespace()).map_or(0, |last| last + 1);
        let digits = &text[..end];
        if digits.len() != 2 * KEY_SECRET_BYTES {
            return Err(invalid(format!(
                "expected exactly {} hex digits and an optional trailing newline, found {} bytes before the trailing whitespace",
                2 * KEY_SECRET_BYTES,
                digits.len()
            )));
        }
        let mut bytes = [0u8; KEY_SECRET_BYTES];
        for (position, (byte, pair)) in bytes.iter_mut().zip(digits.chunks_exact(2)).enumerate() {
            let nibble = |digit: u8| (digit as char).to_digit(16);
            let (Some(high), Some(low)) = (nibble(pair[0]), nibble(pair[1])) else {
                return Err(invalid(format!(
                    "byte {} of the file is not a hex digit",
                    2 * position + usize::from(nibble(pair[0]).is_some())
                )));
            };
            *byte = (high << 4 | low) as u8;
        }
        Self::from_bytes(bytes)
    }

    /// Reads a secret file ([`KeySecret::from_hex`]'s text) at `path`, with its permission bits
    /// and owner so the caller can warn when others may read or write it ([`SecretFile::exposure`]).
    pub fn read_file(path: &std::path::Path) -> Result<SecretFile, ObjstoreError> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let source = |error: std::io::Error| ObjstoreError::KeySecretSource { path: path.display().to_string(), source: error };
        // Only a regular file: opening a FIFO would wait for a writer without bound, and a
        // device could be read for ever. (Checked on the path, then read: one swapped between
        // the two is the caller's own doing, and the read is bounded anyway.)
        if !std::fs::metadata(path).map_err(source)?.is_file() {
            return Err(ObjstoreError::KeySecret { reason: format!("{}: not a regular file", path.display()) });
        }
        let file = std::fs::File::open(path).map_err(source)?;
        let metadata = file.metadata().map_err(source)?;
        let (mode, owner) = (metadata.permissions().mode(), std::os::unix::fs::MetadataExt::uid(&metadata));
        let mut text = Vec::with_capacity(2 * KEY_SECRET_BYTES + 1);
        file.take(SECRET_FILE_BYTES_MAX + 1).read_to_end(&mut text).map_err(source)?;
        if text.len() as u64 > SECRET_FILE_BYTES_MAX {
            return Err(ObjstoreError::KeySecret { reason: format!("{}: longer than {SECRET_FILE_BYTES_MAX} bytes", path.display()) });
        }
        let secret = Self::from_hex(&text).map_err(|error| match error {
            ObjstoreError::KeySecret { reason } => ObjstoreError::KeySecret { reason: format!("{}: {reason}", path.display()) },
            other => other,
        })?;
        Ok(SecretFile { secret, mode, owner })
    }

    /// The secret's bytes, for the superblock's encoding.
    pub fn as_bytes(&self) -> &[u8; KEY_SECRET_BYTES] {
        &self.0
    }

    /// A name for the secret that reveals nothing of it: the first 4 bytes of SHA-256 under a
    /// tag of its own, in hex. Two pools (or cluster nodes) showing one tag share a secret, up
    /// to a 32-bit accident; it is no key nor chain start (another tag), so printing it gives an
    /// attacker nothing to compute keys with.
    pub fn tag(&self) -> String {
        self.tag_bytes().iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// [`KeySecret::tag`]'s bytes: what a cluster member record carries, so that nodes (and
    /// `tutti cluster status`) see members formatted with another secret.
    pub fn tag_bytes(&self) -> [u8; KEY_SECRET_TAG_BYTES] {
        let mut hasher = Sha256::new();
        hasher.update(SECRET_TAG_DOMAIN);
        hasher.update(self.0);
        let digest = hasher.finalize();
        let mut tag = [0; KEY_SECRET_TAG_BYTES];
        tag.copy_from_slice(&digest[..KEY_SECRET_TAG_BYTES]);
        tag
    }
}

/// A key secret read from a file ([`KeySecret::read_file`]).
#[derive(Debug, Clone, Copy)]
pub struct SecretFile {
    pub secret: KeySecret,
    /// The file's permission bits (`st_mode`).
    pub mode: u32,
    /// The file's owner (`st_uid`).
    pub owner: u32,
}

impl SecretFile {
    /// What lets users other than this process's compute the pool's keys from the file, in
    /// words for a warning (not a refusal), or `None`: group or others may read it (the secret
    /// is as good as theirs), may write it (they could plant a secret they know before the next
    /// format), or another user owns it (who can do either). `euid` is this process's
    /// effective user ([`SecretFile::exposure`] passes it).
    pub fn exposure_to(&self, euid: u32) -> Option<String> {
        let mut reasons = Vec::new();
        if self.mode & 0o044 != 0 {
            reasons.push(format!("readable by group or others (mode {:o})", self.mode & 0o7777));
        }
        if self.mode & 0o022 != 0 {
            reasons.push(format!("writable by group or others (mode {:o})", self.mode & 0o7777));
        }
        if self.owner != euid {
            reasons.push(format!("owned by uid {}, not this user (uid {euid})", self.owner));
        }
        (!reasons.is_empty()).then(|| reasons.join(", "))
    }

    /// [`SecretFile::exposure_to`] this process's effective user.
    pub fn exposure(&self) -> Option<String> {
        self.exposure_to(nix::unistd::geteuid().as_raw())
    }
}

/// `N` bytes from the operating system's random source (`/dev/urandom`, the kernel's CSPRNG).
pub(crate) fn os_random<const N: usize>() -> std::io::Result<[u8; N]> {
    use std::io::Read;
    let mut bytes = [0u8; N];
    std::fs::File::open(RANDOM_SOURCE).and_then(|mut file| file.read_exact(&mut bytes))?;
    Ok(bytes)
}

/// SHA-256 of `tag`, `key` (its bytes as they are: a space key, or none), `previous` (u64 LE),
/// the count of `tokens` (u64 LE) and the tokens (u32 LE each): the key of that message
/// ([`key_of_digest`]). (The fixed part, tag and key, is 30 bytes at most: less than one
/// 64-byte SHA-256 block, so no compression can be computed once per chain and reused.)
#[inline]
fn tagged_hash(tag: &[u8; 14], key: &[u8], previous: u64, tokens: &[u32]) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(tag);
    hasher.update(key);
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

/// Keys of every full block of `tokens` in the key space of `chain` (a partial last block has
/// no key: it is not stored), into `out` (cleared first): block 0's key is
/// [`KeyChain::block_key`] from the chain's start, block i's from block i−1's key. The same
/// tokens in another space (another seed: tuttid's model fingerprint and tensor-parallel
/// rank/world size; or another pool's secret) give unrelated keys, so a lookup in one space
/// never finds a block stored in another. With `block_tokens` 0 no block is full: `out` is left
/// empty (the block size may come from an untrusted request, so it is no panic).
pub fn block_keys(chain: &KeyChain, tokens: &[u32], block_tokens: u32, out: &mut Vec<u64>) {
    out.clear();
    if block_tokens == 0 {
        return;
    }
    let mut previous = chain.start;
    for block in tokens.chunks_exact(block_tokens as usize) {
        previous = chain.block_key(previous, block);
        out.push(previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_space_seed_is_hashed_under_its_own_tag() {
        // Goal: a key space's seed is SHA-256 under the tag tutti-space-v1 of 0, the count and
        // the words, so it is no block's key: the same words as a first block give another value.
        let words = [7u32, 8, 9, 10, 11];
        let mut message = b"tutti-space-v1".to_vec();
        message.extend(0u64.to_le_bytes());
        message.extend((words.len() as u64).to_le_bytes());
        words.iter().for_each(|word| message.extend(word.to_le_bytes()));
        let digest = Sha256::digest(&message);
        assert_eq!(space_seed(&words), u64::from_le_bytes(digest[..8].try_into().unwrap()).max(1));
        let chain = KeyChain::new(&counting_secret(), 0);
        assert_ne!(space_seed(&words), chain.block_key(0, &words));
        assert_ne!(space_seed(&words), chain.block_key(chain.start, &words));
    }

    #[test]
    fn keys_depend_on_the_whole_prefix() {
        // Goal: equal prefixes give equal keys; a change in block 0 changes every later key; the
        // same tokens at another position give another key.
        let chain = KeyChain::new(&counting_secret(), 0);
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999;
        let (mut ka, mut kb) = (Vec::new(), Vec::new());
        block_keys(&chain, &a, 16, &mut ka);
        block_keys(&chain, &b, 16, &mut kb);
        assert_eq!(ka.len(), 4);
        assert!(ka.iter().zip(&kb).all(|(x, y)| x != y));
        let mut again = Vec::new();
        block_keys(&chain, &a[..40], 16, &mut again);
        assert_eq!(again, ka[..2]);
        let repeated = vec![5u32; 32];
        block_keys(&chain, &repeated, 16, &mut ka);
        assert_ne!(ka[0], ka[1]);
        assert_ne!(chain.block_key(0, &[1, 2]), chain.block_key(0, &[2, 1]));
        assert_ne!(chain.block_key(0, &[1]), chain.block_key(0, &[1, 0]));
        assert_ne!(chain.block_key(1, &[7; 16]), chain.block_key(2, &[7; 16]));
        assert_ne!(chain.block_key(1 << 32, &[7; 16]), chain.block_key(1, &[7; 16]));
    }

    #[test]
    fn a_chain_is_keyed_by_its_secret_and_seed_at_every_block() {
        // Goal: another seed or another secret changes every key of the same tokens; and block
        // i+1's key depends on the chain's space key, not only on block i's key: the same
        // predecessor and tokens under another chain give another key (what keeps a leaked key
        // from being extended by whoever lacks the secret).
        let tokens: Vec<u32> = (0..48).collect();
        let secret = counting_secret();
        let other_secret = KeySecret::from_bytes([0x42; KEY_SECRET_BYTES]).unwrap();
        let chain = KeyChain::new(&secret, 0xfeed);
        let (mut keys, mut other_seed, mut other_pool) = (Vec::new(), Vec::new(), Vec::new());
        block_keys(&chain, &tokens, 16, &mut keys);
        block_keys(&KeyChain::new(&secret, 0xfeee), &tokens, 16, &mut other_seed);
        block_keys(&KeyChain::new(&other_secret, 0xfeed), &tokens, 16, &mut other_pool);
        assert!(keys.iter().zip(&other_seed).all(|(a, b)| a != b));
        assert!(keys.iter().zip(&other_pool).all(|(a, b)| a != b));
        assert_eq!(keys[0], chain.block_key(chain.start, &tokens[..16]));
        assert_eq!(keys[1], chain.block_key(keys[0], &tokens[16..32]));
        for other in [KeyChain::new(&secret, 0xfeee), KeyChain::new(&other_secret, 0xfeed)] {
            assert_ne!(other.block_key(keys[0], &tokens[16..32]), keys[1]);
        }
        assert_eq!(format!("{chain:?}"), "KeyChain(<redacted>)");
    }

    #[test]
    fn blocks_of_zero_tokens_have_no_keys_and_no_panic() {
        // Goal: the public key function takes its block size from the caller (a tuttid
        // client's request, a geometry not yet validated); 0 tokens per block used to panic in
        // `chunks_exact(0)`. No block is full then: no keys, and what `out` held is cleared.
        let chain = KeyChain::new(&counting_secret(), 0xfeed);
        let tokens: Vec<u32> = (0..32).collect();
        let mut keys = vec![7, 8];
        block_keys(&chain, &tokens, 0, &mut keys);
        assert!(keys.is_empty(), "{keys:?}");
        keys.push(9);
        block_keys(&chain, &[], 0, &mut keys);
        assert!(keys.is_empty(), "{keys:?}");
    }

    /// The encoding the keys are defined by, built in one buffer and hashed in one call: what
    /// `KeyChain::block_key`'s incremental, buffered feeding must agree with.
    fn reference_key(space_key: &[u8; SPACE_KEY_BYTES], previous: u64, tokens: &[u32]) -> u64 {
        use sha2::{Digest, Sha256};
        let mut message = b"tutti-block-v2".to_vec();
        message.extend_from_slice(space_key);
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
    fn keys_are_the_first_64_bits_of_sha256_over_tag_space_key_previous_count_and_tokens() {
        // Goal: the key is SHA-256 (not a fast mix a chooser of tokens can steer) over an
        // unambiguous encoding: a fixed tag, the space key, the predecessor, the token count,
        // the tokens. Block sizes around the 64-token stack buffer and 64-byte SHA blocks, and
        // an empty block.
        let chain = KeyChain::new(&counting_secret(), 0xfeed);
        for len in [0usize, 1, 3, 15, 16, 17, 32, 63, 64, 65, 128, 200] {
            let tokens: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(0x9E37_79B9) ^ 0x8000_0001).collect();
            for previous in [0, 1, 0xfeed, u64::MAX] {
                assert_eq!(
                    chain.block_key(previous, &tokens),
                    reference_key(&chain.space_key, previous, &tokens),
                    "{len} tokens after {previous:#x}"
                );
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
        let chain = KeyChain::new(&counting_secret(), 0);
        let tokens: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_256).collect();
        let mut keys = Vec::with_capacity(256);
        let mut runs: Vec<f64> = (0..15)
            .map(|_| {
                let started = std::time::Instant::now();
                for _ in 0..200 {
                    block_keys(&chain, std::hint::black_box(&tokens), 16, &mut keys);
                    std::hint::black_box(&keys);
                }
                started.elapsed().as_nanos() as f64 / (200.0 * 256.0)
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        eprintln!("block_keys, 16-token blocks: median {:.1} ns/block (min {:.1}, max {:.1}, 15 runs)", runs[7], runs[0], runs[14]);
    }

    // Also computed with Python's hashlib over the same encoding: the first two keys of tokens
    // 0..16 twice in the chain of counting_secret() and seed 0 (space key: bytes 8..24 of
    // SHA-256(b"tutti-keyed-v1" + bytes(range(1, 33)) + (0).to_bytes(8, "little"))).
    const GOLDEN_FIRST: u64 = 0x24b3_9c1a_74c0_dbe0;
    const GOLDEN_SECOND: u64 = 0x8e62_d675_7d16_97e1;

    // Also computed with Python's hashlib: SHA-256(b"tutti-keyed-v1" + bytes(range(1, 33)) +
    // seed.to_bytes(8, "little")), the first 8 bytes little-endian (the chain's start); and the
    // secret's tag.
    const GOLDEN_KEYED_START_0: u64 = 0xe9f5_77cd_c556_b57d;
    const GOLDEN_KEYED_START_FEED: u64 = 0x9535_549d_634b_d952;
    const GOLDEN_SECRET_TAG: &str = "75349e23";

    fn counting_secret() -> KeySecret {
        KeySecret::from_bytes(core::array::from_fn(|i| i as u8 + 1)).unwrap()
    }

    #[test]
    fn the_keyed_chain_is_sha256_of_its_tag_the_secret_and_the_seed() {
        // Goal: the chain's start and space key are pinned (they decide every key on disk from
        // version 5 on), they depend on both the secret and the seed, and the start is not the
        // seed (its own tag).
        let secret = counting_secret();
        assert_eq!(KeyChain::new(&secret, 0).start, GOLDEN_KEYED_START_0);
        assert_eq!(KeyChain::new(&secret, 0xfeed).start, GOLDEN_KEYED_START_FEED);
        let digest = Sha256::digest([&b"tutti-keyed-v1"[..], secret.as_bytes(), &0xfeed_u64.to_le_bytes()].concat());
        assert_eq!(KeyChain::new(&secret, 0xfeed).space_key[..], digest[8..24]);
        let mut other = *secret.as_bytes();
        other[31] ^= 1;
        let other = KeySecret::from_bytes(other).unwrap();
        assert_ne!(KeyChain::new(&other, 0xfeed).start, GOLDEN_KEYED_START_FEED);
        assert_ne!(KeyChain::new(&other, 0xfeed).space_key, KeyChain::new(&secret, 0xfeed).space_key);
        assert_ne!(KeyChain::new(&secret, 0xfeed).start, 0xfeed);
        assert_eq!(secret.tag(), GOLDEN_SECRET_TAG);
        assert_eq!(secret.tag_bytes(), [0x75, 0x34, 0x9e, 0x23], "the tag's bytes are those it prints");
        assert_ne!(other.tag(), secret.tag());
    }

    #[test]
    fn a_key_secret_is_never_printed_nor_zero() {
        // Goal: Debug shows no byte of a secret (superblocks and errors are printed with it),
        // and all zeroes (an unset field) is refused.
        let secret = counting_secret();
        assert_eq!(format!("{secret:?}"), "KeySecret(<redacted>)");
        assert_eq!(format!("{secret:#?}"), "KeySecret(<redacted>)");
        assert!(matches!(KeySecret::from_bytes([0; KEY_SECRET_BYTES]), Err(ObjstoreError::KeySecret { .. })));
        let random = KeySecret::random().unwrap();
        assert_ne!(random, KeySecret::random().unwrap(), "two reads of /dev/urandom agreed");
    }

    #[test]
    fn a_secret_file_is_64_hex_digits_and_errors_never_echo_it() {
        // Goal: the secret file's text is exactly 64 hex digits (either case) with optional
        // trailing whitespace; anything else is a typed error that says what is wrong without
        // printing the text (which may be a secret with one typo).
        let hex: String = counting_secret().as_bytes().iter().map(|byte| format!("{byte:02x}")).collect();
        for text in [hex.clone(), format!("{hex}\n"), format!("{hex} \r\n\t"), hex.to_uppercase()] {
            assert_eq!(KeySecret::from_hex(text.as_bytes()).unwrap(), counting_secret(), "{text:?}");
        }
        let mut typo = hex.clone().into_bytes();
        typo[17] = b'g';
        let short = &hex[..63];
        let long = format!("{hex}0");
        let inner_space = format!("{} {}", &hex[..32], &hex[32..]);
        let leading = format!(" {hex}");
        let cases: [(&[u8], &str); 7] = [
            (&typo, "byte 17"),
            (short.as_bytes(), "found 63"),
            (long.as_bytes(), "found 65"),
            (inner_space.as_bytes(), "found 65"),
            (leading.as_bytes(), "found 65"),
            (b"", "found 0"),
            (&[0xff; 64], "byte 0"),
        ];
        for (text, expected) in cases {
            let error = KeySecret::from_hex(text).unwrap_err();
            let message = error.to_string();
            assert!(matches!(error, ObjstoreError::KeySecret { .. }) && message.contains(expected), "{message}");
            assert!(!message.contains(&hex[..16]) && !message.contains(&hex[40..]), "{message}");
        }
        let zeros = "0".repeat(64);
        assert!(KeySecret::from_hex(zeros.as_bytes()).unwrap_err().to_string().contains("zero"));
    }

    #[test]
    fn a_secret_file_is_read_with_its_mode_and_bounded() {
        // Goal: read_file returns the secret, the file's mode and owner (readable or writable by
        // group or others, or owned by another user, is reported, for a warning); a missing file or one past the size bound is an error
        // naming the path, not the content.
        use std::os::unix::fs::PermissionsExt;
        let directory = std::env::temp_dir().join(format!("tutti-secret-{}-{:?}", std::process::id(), std::thread::current().id()));
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("secret");
        let hex: String = counting_secret().as_bytes().iter().map(|byte| format!("{byte:02x}")).collect();
        std::fs::write(&path, format!("{hex}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let file = KeySecret::read_file(&path).unwrap();
        assert_eq!(file.secret, counting_secret());
        assert_eq!(file.exposure(), None, "{:o}", file.mode);
        assert_eq!(
            file.exposure_to(file.owner + 1).unwrap(),
            format!("owned by uid {}, not this user (uid {})", file.owner, file.owner + 1)
        );
        for (mode, expected) in [
            (0o640, "readable by group or others (mode 640)"),
            (0o604, "readable by group or others (mode 604)"),
            (0o620, "writable by group or others (mode 620)"),
            (0o622, "writable by group or others (mode 622)"),
            (0o666, "readable by group or others (mode 666), writable by group or others (mode 666)"),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(KeySecret::read_file(&path).unwrap().exposure().as_deref(), Some(expected), "{mode:o}");
        }
        std::fs::write(&path, hex.repeat(100)).unwrap();
        let message = KeySecret::read_file(&path).unwrap_err().to_string();
        assert!(message.contains("longer than") && message.contains("secret") && !message.contains(&hex[..16]), "{message}");
        let message = KeySecret::read_file(&directory).unwrap_err().to_string();
        assert!(message.contains("not a regular file"), "{message}");
        let missing = directory.join("missing");
        let error = KeySecret::read_file(&missing).unwrap_err();
        assert!(matches!(&error, ObjstoreError::KeySecretSource { path, .. } if path.contains("missing")), "{error}");
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn the_scheme_is_pinned_by_the_format_version() {
        // Goal: keys are on disk; a change to the scheme must fail here and come with a new
        // FORMAT_VERSION (these values belong to version 5: SHA-256 keys, every block keyed with
        // its chain's space key, the chain pinned above).
        assert_eq!(crate::format::FORMAT_VERSION, 5);
        let tokens: Vec<u32> = (0..16).collect();
        let mut keys = Vec::new();
        block_keys(&KeyChain::new(&counting_secret(), 0), &tokens.repeat(2), 16, &mut keys);
        let (first, second) = (keys[0], keys[1]);
        assert_eq!((first, second), (GOLDEN_FIRST, GOLDEN_SECOND), "{first:#x} {second:#x}");
    }
}
