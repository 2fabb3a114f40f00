//! Validated names: cluster and node ids (they are parts of etcd keys), a model's key space
//! (fingerprint + tensor-parallel shape) and segment keys.

use std::fmt;

use crate::error::{ClusterError, Result};

/// Longest cluster or node id, in bytes: keys stay short and one length byte encodes it.
pub const NAME_BYTES_MAX: usize = 64;
/// Bytes of a model fingerprint (a hash of the model's identity, as in tuttid's `Hello`).
pub const FINGERPRINT_BYTES: usize = 32;
/// Largest tensor-parallel world size (the same bound tuttid's protocol has).
pub const TP_WORLD_MAX: u32 = 1024;

fn check_name(kind: &str, text: &str) -> Result<()> {
    let allowed = |byte: u8| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'-' || byte == b'_';
    if text.is_empty() || text.len() > NAME_BYTES_MAX || !text.bytes().all(allowed) {
        return Err(ClusterError::InvalidSetting(format!(
            "{kind} {text:?} must be 1..={NAME_BYTES_MAX} characters of a-z, 0-9, '-' or '_'"
        )));
    }
    Ok(())
}

/// Names one fleet: every key of the cluster lies under `/tutti/<cluster id>/`, so two fleets
/// may share an etcd without ever reading each other's records.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterId(String);

impl ClusterId {
    pub fn new(text: &str) -> Result<ClusterId> {
        check_name("cluster id", text)?;
        Ok(ClusterId(text.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// Names one tuttid node within a cluster (stable across restarts, e.g. the host name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(String);

impl NodeId {
    pub fn new(text: &str) -> Result<NodeId> {
        check_name("node id", text)?;
        Ok(NodeId(text.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// The key space of a model's blocks: its fingerprint and tensor-parallel shape, checked here
/// once for the whole workspace (tuttid's `KeySpace` is built on it). tuttid seeds the block-key
/// chain with these; the registry also puts them in every segment's etcd key, so a 64-bit hash
/// collision between two models (or two ranks) cannot join their prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelSpace {
    fingerprint: [u8; FINGERPRINT_BYTES],
    tp_rank: u32,
    tp_world: u32,
}

impl ModelSpace {
    /// Refuses an all-zero fingerprint (it names no model), a world outside 1..=[`TP_WORLD_MAX`]
    /// and a rank not below the world.
    pub fn new(fingerprint: [u8; FINGERPRINT_BYTES], tp_rank: u32, tp_world: u32) -> Result<ModelSpace> {
        if fingerprint.iter().all(|&byte| byte == 0) {
            return Err(ClusterError::InvalidSetting(
                "the model fingerprint is all zeroes; give the model's identity (e.g. a SHA-256 of its config)".into(),
            ));
        }
        if tp_world == 0 || tp_world > TP_WORLD_MAX {
            return Err(ClusterError::InvalidSetting(format!("tensor-parallel world size {tp_world} is outside 1..={TP_WORLD_MAX}")));
        }
        if tp_rank >= tp_world {
            return Err(ClusterError::InvalidSetting(format!("tensor-parallel rank {tp_rank} is not below the world size {tp_world}")));
        }
        Ok(ModelSpace { fingerprint, tp_rank, tp_world })
    }
    pub fn fingerprint(&self) -> &[u8; FINGERPRINT_BYTES] {
        &self.fingerprint
    }
    pub fn tp_rank(&self) -> u32 {
        self.tp_rank
    }
    pub fn tp_world(&self) -> u32 {
        self.tp_world
    }
}

/// The chained prefix hash of a segment's last block (objstore's block key there): it names the
/// whole prefix up to and including the segment. Never 0 (`objstore::hash::KeyChain::block_key` never returns 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentKey(u64);

impl SegmentKey {
    pub fn new(key: u64) -> Result<SegmentKey> {
        if key == 0 {
            return Err(ClusterError::InvalidSetting("segment key 0 names no block".into()));
        }
        Ok(SegmentKey(key))
    }
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for SegmentKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{:016x}", self.0)
    }
}

/// Bytes of a [`KeySecretTag`].
pub const KEY_SECRET_TAG_BYTES: usize = 4;

/// The non-secret name of a node's pool key secret (`objstore::hash::KeySecret::tag_bytes`):
/// nodes find each other's segments by block keys keyed with that secret, so two nodes whose
/// tags differ share nothing. Carried in every member record so that a node and `tutti cluster
/// status` can say so; it reveals nothing of the secret. Shown as 8 hex digits, as `tutti pool
/// inspect` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeySecretTag([u8; KEY_SECRET_TAG_BYTES]);

impl KeySecretTag {
    pub const fn new(bytes: [u8; KEY_SECRET_TAG_BYTES]) -> KeySecretTag {
        KeySecretTag(bytes)
    }
    pub fn bytes(&self) -> [u8; KEY_SECRET_TAG_BYTES] {
        self.0
    }
}

impl fmt::Display for KeySecretTag {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|byte| write!(formatter, "{byte:02x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_refuse_what_would_break_a_key() {
        // Goal: a name can never add a path separator, upper case or another byte to a key.
        assert!(NodeId::new("node-a_1").is_ok());
        for bad in ["", "a/b", "A", "node a", "é", &"x".repeat(NAME_BYTES_MAX + 1)] {
            assert!(NodeId::new(bad).is_err(), "{bad:?}");
            assert!(ClusterId::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn model_space_is_checked() {
        // Goal: the same checks tuttid makes of a session's identity.
        assert!(ModelSpace::new([0; 32], 0, 1).is_err());
        assert!(ModelSpace::new([1; 32], 1, 1).is_err());
        assert!(ModelSpace::new([1; 32], 0, 0).is_err());
        assert!(ModelSpace::new([1; 32], 0, TP_WORLD_MAX + 1).is_err());
        assert!(ModelSpace::new([1; 32], 3, 4).is_ok());
        assert!(SegmentKey::new(0).is_err());
    }

    #[test]
    fn a_key_secret_tag_prints_as_tutti_pool_inspect_does() {
        // Goal: the tag a member record carries reads as the one `tutti pool inspect` prints
        // (objstore's `KeySecret::tag`): 8 lowercase hex digits, first byte first.
        let secret = objstore::hash::KeySecret::from_bytes([7; 32]).unwrap();
        assert_eq!(KeySecretTag::new(secret.tag_bytes()).to_string(), secret.tag());
        assert_eq!(KeySecretTag::new([0x0a, 0xb0, 0, 0xff]).to_string(), "0ab000ff");
    }
}
