//! Where records live in etcd and what their bytes are.
//!
//! Keys (all under the cluster's prefix, so fleets sharing an etcd never meet):
//!
//! ```text
//! /tutti/<cluster>/v4/node/<node>                                          a member (MemberRecord)
//! /tutti/<cluster>/v4/seg/<fingerprint hex>/<rank>.<world>/<key hex>/<node>  a holder (SegmentRecord)
//! ```
//!
//! The format version is the third component: a reader of v4 reads only under `/v4/`, and
//! `tutti cluster status` counts keys of other versions instead of decoding them. Version 2
//! changed no record: it marks the segment keys, block keys since pool format 4 (SHA-256), where
//! version 1 nodes named a prompt's segments by the old fast mix. Version 3 changed no record
//! either: segment keys keyed with the pool's secret since pool format 5, where version 2 nodes'
//! keys are unkeyed. A node of either scheme finds none of the other's holders and does not see
//! it as a member, and `status` counts the other's keys as of another version, so a mixed
//! cluster shows itself rather than only missing. Version 4 added the node's pool key secret tag
//! to the member record ([`KeySecretTag`]): nodes of one build whose pools have different
//! secrets share nothing either, and with the tag each node (at its join) and `status` see it.
//! Values are
//! binary records with a magic, the format version, every field of the key again (cluster, node,
//! space, segment key — a value copied under another key is refused) and a CRC-32 (crc32fast) of
//! the bytes before it. A record that fails any check is skipped and
//! counted by readers, never trusted.

use crate::names::{ClusterId, KeySecretTag, ModelSpace, NodeId, SegmentKey, FINGERPRINT_BYTES, KEY_SECRET_TAG_BYTES, NAME_BYTES_MAX};
use crate::segments::SegmentBlocks;

/// The version of the key layout and record formats below.
pub const FORMAT_VERSION: u16 = 4;
const MEMBER_MAGIC: &[u8; 4] = b"TNOD";
const SEGMENT_MAGIC: &[u8; 4] = b"TSEG";
/// Longest node address (host:port or a URL) a member record carries.
pub const ADDRESS_BYTES_MAX: usize = 256;
/// Most model fingerprints one member record lists.
pub const FINGERPRINTS_MAX: usize = 64;

/// What one key-value entry costs in a range answer besides its key and value bytes: etcd's
/// `KeyValue` framing (key and value tags and lengths, four varint fields of up to 11 bytes:
/// 50) and its place in the answer's list (3), rounded up.
const ENTRY_FRAMING_BYTES: usize = 64;
/// The longest holder key: `/tutti/` + cluster + `/v4/seg/` + 64 hex digits + `/rank.world/`
/// (4 + 1 + 4 digits) + 16 hex digits + `/` + node (names at most 64 bytes): 235 bytes.
const SEGMENT_KEY_BYTES_MAX: usize = 7 + NAME_BYTES_MAX + 8 + 2 * FINGERPRINT_BYTES + 11 + 16 + 1 + NAME_BYTES_MAX;
/// The longest holder value ([`SegmentRecord::encode`]): 194 bytes.
const SEGMENT_VALUE_BYTES_MAX: usize = 4 + 2 + 2 * (1 + NAME_BYTES_MAX) + FINGERPRINT_BYTES + 4 + 4 + 8 + 4 + 2 + 4;
/// The most bytes one sound holder entry takes in a range answer (493, rounded up): a lookup
/// of `holders_max` × `txn_ops_max` of them must fit one answer (`ClusterConfig::validate`).
pub const SEGMENT_ENTRY_BYTES_MAX: usize = (SEGMENT_KEY_BYTES_MAX + SEGMENT_VALUE_BYTES_MAX + ENTRY_FRAMING_BYTES).next_power_of_two();
/// The longest member key: `/tutti/` + cluster + `/v4/node/` + node: 144 bytes.
const MEMBER_KEY_BYTES_MAX: usize = 7 + NAME_BYTES_MAX + 9 + NAME_BYTES_MAX;
/// The longest member value ([`MemberRecord::encode`]): 2,460 bytes.
const MEMBER_VALUE_BYTES_MAX: usize =
    4 + 2 + 2 * (1 + NAME_BYTES_MAX) + KEY_SECRET_TAG_BYTES + 8 + 2 + ADDRESS_BYTES_MAX + 2 + FINGERPRINTS_MAX * FINGERPRINT_BYTES + 4;
/// The most bytes one sound member entry takes in a range answer (2,668, rounded up): what a
/// page of the member list or of `status`'s scan is sized by.
pub const MEMBER_ENTRY_BYTES_MAX: usize = (MEMBER_KEY_BYTES_MAX + MEMBER_VALUE_BYTES_MAX + ENTRY_FRAMING_BYTES).next_power_of_two();
/// What one range read adds to a transaction's answer besides its entries (its header, `more`,
/// `count` and framing), rounded up.
pub const RANGE_OVERHEAD_BYTES: usize = 128;
/// What an answer adds besides its ranges (its header and framing), rounded up.
pub const ANSWER_OVERHEAD_BYTES: usize = 1024;

/// The key names of one cluster.
#[derive(Debug, Clone)]
pub struct KeyLayout {
    cluster: ClusterId,
    version_prefix: String,
}

impl KeyLayout {
    pub fn new(cluster: ClusterId) -> KeyLayout {
        let version_prefix = format!("/tutti/{cluster}/v{FORMAT_VERSION}/");
        KeyLayout { cluster, version_prefix }
    }
    pub fn cluster(&self) -> &ClusterId {
        &self.cluster
    }
    /// Every key of the cluster, of any format version.
    pub fn cluster_prefix(&self) -> String {
        format!("/tutti/{}/", self.cluster)
    }
    /// Every key of this format version.
    pub fn version_prefix(&self) -> &str {
        &self.version_prefix
    }
    pub fn members_prefix(&self) -> String {
        format!("{}node/", self.version_prefix)
    }
    pub fn member_key(&self, node: &NodeId) -> String {
        format!("{}node/{node}", self.version_prefix)
    }
    pub fn segments_prefix(&self) -> String {
        format!("{}seg/", self.version_prefix)
    }
    /// The prefix under which every holder of `key` in `space` registers (one range read).
    pub fn holders_prefix(&self, space: &ModelSpace, key: SegmentKey) -> String {
        let mut text = format!("{}seg/", self.version_prefix);
        for byte in space.fingerprint() {
            text.push_str(&format!("{byte:02x}"));
        }
        text.push_str(&format!("/{}.{}/{key}/", space.tp_rank(), space.tp_world()));
        text
    }
    pub fn segment_key(&self, space: &ModelSpace, key: SegmentKey, node: &NodeId) -> String {
        let mut text = self.holders_prefix(space, key);
        text.push_str(node.as_str());
        text
    }

    /// The node a member key names, or None for a key that is not one of this layout's.
    pub fn parse_member_key(&self, key: &[u8]) -> Option<NodeId> {
        let text = std::str::from_utf8(key).ok()?;
        NodeId::new(text.strip_prefix(&self.members_prefix())?).ok()
    }

    /// The space, segment key and node a holder key names, or None.
    pub fn parse_segment_key(&self, key: &[u8]) -> Option<(ModelSpace, SegmentKey, NodeId)> {
        let text = std::str::from_utf8(key).ok()?;
        let rest = text.strip_prefix(&self.segments_prefix())?;
        let mut parts = rest.split('/');
        let (fingerprint_hex, shape, key_hex, node) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || fingerprint_hex.len() != 2 * FINGERPRINT_BYTES || key_hex.len() != 16 {
            return None;
        }
        let mut fingerprint = [0u8; FINGERPRINT_BYTES];
        for (byte, pair) in fingerprint.iter_mut().zip(fingerprint_hex.as_bytes().chunks_exact(2)) {
            *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        let (rank, world) = shape.split_once('.')?;
        let space = ModelSpace::new(fingerprint, rank.parse().ok()?, world.parse().ok()?).ok()?;
        let segment = SegmentKey::new(u64::from_str_radix(key_hex, 16).ok()?).ok()?;
        // The canonical spelling only: "+1" or upper-case hex would name the same record twice.
        if self.segment_key(&space, segment, &NodeId::new(node).ok()?) != text {
            return None;
        }
        Some((space, segment, NodeId::new(node).ok()?))
    }
}

/// A member's registration: where it serves and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRecord {
    pub node: NodeId,
    /// Its pool's key secret tag: a node of another tag computes other block keys for the same
    /// prompt, so the two share nothing.
    pub key_secret_tag: KeySecretTag,
    /// Where the node's data plane listens (host:port); carried, not interpreted, here.
    pub address: String,
    pub capacity_bytes: u64,
    pub fingerprints: Vec<[u8; FINGERPRINT_BYTES]>,
}

/// A holder's registration of one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRecord {
    pub node: NodeId,
    pub space: ModelSpace,
    pub key: SegmentKey,
    /// Position of the segment in its prompt's chain (0-based).
    pub index: u32,
    pub segment_blocks: SegmentBlocks,
}

struct Writer(Vec<u8>);

impl Writer {
    fn new(magic: &[u8; 4]) -> Writer {
        let mut bytes = Vec::with_capacity(128);
        bytes.extend_from_slice(magic);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        Writer(bytes)
    }
    fn bytes(&mut self, data: &[u8]) {
        self.0.extend_from_slice(data);
    }
    /// A name of at most [`NAME_BYTES_MAX`] bytes (checked by its type) behind one length byte.
    fn name(&mut self, text: &str) {
        debug_assert!(text.len() <= NAME_BYTES_MAX);
        self.0.push(text.len() as u8);
        self.0.extend_from_slice(text.as_bytes());
    }
    fn finish(mut self) -> Vec<u8> {
        let crc = crc32fast::hash(&self.0);
        self.0.extend_from_slice(&crc.to_le_bytes());
        self.0
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Checks the trailing CRC, the magic and the version; the reader then walks the fields.
    fn open(bytes: &'a [u8], magic: &[u8; 4]) -> Result<Reader<'a>, &'static str> {
        if bytes.len() < 4 + 2 + 4 {
            return Err("shorter than a record header");
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        if crc32fast::hash(body).to_le_bytes() != crc {
            return Err("checksum mismatch");
        }
        if &body[..4] != magic {
            return Err("wrong magic");
        }
        if body[4..6] != FORMAT_VERSION.to_le_bytes() {
            return Err("another format version");
        }
        Ok(Reader { rest: &body[6..] })
    }
    fn take(&mut self, count: usize) -> Result<&'a [u8], &'static str> {
        if self.rest.len() < count {
            return Err("truncated");
        }
        let (head, tail) = self.rest.split_at(count);
        self.rest = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| "truncated")?))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "truncated")?))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "truncated")?))
    }
    fn fingerprint(&mut self) -> Result<[u8; FINGERPRINT_BYTES], &'static str> {
        self.take(FINGERPRINT_BYTES)?.try_into().map_err(|_| "truncated")
    }
    fn name(&mut self) -> Result<&'a str, &'static str> {
        let length = usize::from(self.take(1)?[0]);
        std::str::from_utf8(self.take(length)?).map_err(|_| "a name is not UTF-8")
    }
    fn end(&self) -> Result<(), &'static str> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err("trailing bytes")
        }
    }
}

impl MemberRecord {
    /// The record's bytes; refuses what every reader would refuse (an address over
    /// [`ADDRESS_BYTES_MAX`] bytes, more than [`FINGERPRINTS_MAX`] fingerprints), rather than
    /// writing a record nobody accepts.
    pub fn encode(&self, cluster: &ClusterId) -> Result<Vec<u8>, &'static str> {
        if self.address.len() > ADDRESS_BYTES_MAX {
            return Err("address too long");
        }
        if self.fingerprints.len() > FINGERPRINTS_MAX {
            return Err("too many fingerprints");
        }
        // Both fit their u16 lengths: checked just above.
        let address_bytes = u16::try_from(self.address.len()).map_err(|_| "address too long")?;
        let fingerprints = u16::try_from(self.fingerprints.len()).map_err(|_| "too many fingerprints")?;
        let mut writer = Writer::new(MEMBER_MAGIC);
        writer.name(cluster.as_str());
        writer.name(self.node.as_str());
        writer.bytes(&self.key_secret_tag.bytes());
        writer.bytes(&self.capacity_bytes.to_le_bytes());
        writer.bytes(&address_bytes.to_le_bytes());
        writer.bytes(self.address.as_bytes());
        writer.bytes(&fingerprints.to_le_bytes());
        for fingerprint in &self.fingerprints {
            writer.bytes(fingerprint);
        }
        Ok(writer.finish())
    }

    /// Decodes a member value read at the key that names `node` in `cluster`; every field of
    /// the key must agree with the value.
    pub fn decode(bytes: &[u8], cluster: &ClusterId, node: &NodeId) -> Result<MemberRecord, &'static str> {
        let mut reader = Reader::open(bytes, MEMBER_MAGIC)?;
        if reader.name()? != cluster.as_str() {
            return Err("another cluster's record");
        }
        if reader.name()? != node.as_str() {
            return Err("the record names another node than its key");
        }
        let key_secret_tag = KeySecretTag::new(reader.take(KEY_SECRET_TAG_BYTES)?.try_into().map_err(|_| "truncated")?);
        let capacity_bytes = reader.u64()?;
        let address_bytes = usize::from(reader.u16()?);
        if address_bytes > ADDRESS_BYTES_MAX {
            return Err("address too long");
        }
        let address = std::str::from_utf8(reader.take(address_bytes)?).map_err(|_| "address is not UTF-8")?;
        let count = usize::from(reader.u16()?);
        if count > FINGERPRINTS_MAX {
            return Err("too many fingerprints");
        }
        let mut fingerprints = Vec::with_capacity(count);
        for _ in 0..count {
            fingerprints.push(reader.fingerprint()?);
        }
        reader.end()?;
        Ok(MemberRecord { node: node.clone(), key_secret_tag, address: address.to_owned(), capacity_bytes, fingerprints })
    }
}

impl SegmentRecord {
    pub fn encode(&self, cluster: &ClusterId) -> Vec<u8> {
        let mut writer = Writer::new(SEGMENT_MAGIC);
        writer.name(cluster.as_str());
        writer.name(self.node.as_str());
        writer.bytes(self.space.fingerprint());
        writer.bytes(&self.space.tp_rank().to_le_bytes());
        writer.bytes(&self.space.tp_world().to_le_bytes());
        writer.bytes(&self.key.get().to_le_bytes());
        writer.bytes(&self.index.to_le_bytes());
        writer.bytes(&self.segment_blocks.get().to_le_bytes());
        writer.finish()
    }

    /// Decodes a holder value read at the key naming (`space`, `key`, `node`) in `cluster`.
    pub fn decode(
        bytes: &[u8],
        cluster: &ClusterId,
        space: &ModelSpace,
        key: SegmentKey,
        node: &NodeId,
    ) -> Result<SegmentRecord, &'static str> {
        let mut reader = Reader::open(bytes, SEGMENT_MAGIC)?;
        if reader.name()? != cluster.as_str() {
            return Err("another cluster's record");
        }
        if reader.name()? != node.as_str() {
            return Err("the record names another node than its key");
        }
        let fingerprint = reader.fingerprint()?;
        let (rank, world) = (reader.u32()?, reader.u32()?);
        if fingerprint != *space.fingerprint() || rank != space.tp_rank() || world != space.tp_world() {
            return Err("the record names another model space than its key");
        }
        if reader.u64()? != key.get() {
            return Err("the record names another segment than its key");
        }
        let index = reader.u32()?;
        let segment_blocks = SegmentBlocks::new(reader.u16()?).map_err(|_| "segment size out of range")?;
        reader.end()?;
        Ok(SegmentRecord { node: node.clone(), space: *space, key, index, segment_blocks })
    }
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KeyLayout {
        KeyLayout::new(ClusterId::new("fleet").unwrap())
    }

    fn segment() -> SegmentRecord {
        SegmentRecord {
            node: NodeId::new("a").unwrap(),
            space: ModelSpace::new([7; 32], 1, 2).unwrap(),
            key: SegmentKey::new(0xabc).unwrap(),
            index: 3,
            segment_blocks: SegmentBlocks::new(32).unwrap(),
        }
    }

    #[test]
    fn keys_round_trip_and_refuse_other_spellings() {
        // Goal: a holder key parses back to what built it; any other spelling (another version,
        // cluster, upper-case hex, extra component) parses to None.
        let layout = layout();
        let record = segment();
        let key = layout.segment_key(&record.space, record.key, &record.node);
        assert_eq!(layout.parse_segment_key(key.as_bytes()), Some((record.space, record.key, record.node.clone())));
        for bad in [
            key.replace("/v4/", "/v3/"),
            key.replace("/fleet/", "/other/"),
            key.replace("0000000000000abc", "0000000000000ABC"),
            format!("{key}/x"),
            key.replace("/1.2/", "/2.2/"),
        ] {
            assert_eq!(layout.parse_segment_key(bad.as_bytes()), None, "{bad}");
        }
        let node = NodeId::new("n1").unwrap();
        assert_eq!(layout.parse_member_key(layout.member_key(&node).as_bytes()), Some(node));
    }

    #[test]
    fn records_round_trip_and_every_corruption_is_refused() {
        // Goal: a flipped byte anywhere, a truncation, another cluster, node, space or key are
        // refused; the record itself decodes to what was encoded.
        let cluster = ClusterId::new("fleet").unwrap();
        let record = segment();
        let bytes = record.encode(&cluster);
        let decode = |bytes: &[u8]| SegmentRecord::decode(bytes, &cluster, &record.space, record.key, &record.node);
        assert_eq!(decode(&bytes), Ok(record.clone()));
        for position in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[position] ^= 0x10;
            assert!(decode(&flipped).is_err(), "byte {position}");
        }
        for length in 0..bytes.len() {
            assert!(decode(&bytes[..length]).is_err(), "length {length}");
        }
        let other = ClusterId::new("other").unwrap();
        assert_eq!(decode(&record.encode(&other)), Err("another cluster's record"));
        let other_node = NodeId::new("b").unwrap();
        assert!(SegmentRecord::decode(&bytes, &cluster, &record.space, record.key, &other_node).is_err());
        let other_key = SegmentKey::new(0xabd).unwrap();
        assert!(SegmentRecord::decode(&bytes, &cluster, &record.space, other_key, &record.node).is_err());

        let member = MemberRecord {
            node: NodeId::new("a").unwrap(),
            key_secret_tag: KeySecretTag::new([0xc0, 0xff, 0xee, 0x01]),
            address: "10.0.0.1:7000".into(),
            capacity_bytes: 1 << 40,
            fingerprints: vec![[1; 32], [2; 32]],
        };
        let bytes = member.encode(&cluster).unwrap();
        assert_eq!(MemberRecord::decode(&bytes, &cluster, &member.node), Ok(member.clone()));
        for length in 0..bytes.len() {
            assert!(MemberRecord::decode(&bytes[..length], &cluster, &member.node).is_err());
        }
        assert!(MemberRecord::decode(&bytes, &other, &member.node).is_err());
    }

    #[test]
    fn a_member_record_that_no_reader_accepts_is_not_encoded() {
        // Goal: an address or fingerprint list past the bounds readers enforce is refused by
        // encode too, rather than written as a record every reader refuses (an address of
        // 65,546 bytes used to wrap its u16 length to 10; one of 257 bytes was written as
        // given); the largest accepted record round-trips.
        let cluster = ClusterId::new("fleet").unwrap();
        let mut member = MemberRecord {
            node: NodeId::new("a").unwrap(),
            key_secret_tag: KeySecretTag::new([1; KEY_SECRET_TAG_BYTES]),
            address: "x".repeat(ADDRESS_BYTES_MAX),
            capacity_bytes: 1,
            fingerprints: vec![[3; 32]; FINGERPRINTS_MAX],
        };
        let bytes = member.encode(&cluster).unwrap();
        assert_eq!(MemberRecord::decode(&bytes, &cluster, &member.node), Ok(member.clone()));
        for address_bytes in [ADDRESS_BYTES_MAX + 1, 65_536 + 10] {
            let long = MemberRecord { address: "x".repeat(address_bytes), ..member.clone() };
            assert_eq!(long.encode(&cluster), Err("address too long"), "{address_bytes}");
        }
        member.fingerprints.push([4; 32]);
        assert_eq!(member.encode(&cluster), Err("too many fingerprints"));
    }

    #[test]
    fn the_entry_bounds_hold_the_longest_records() {
        // Goal: the byte bounds that size every read (`ClusterConfig::validate`, the scans'
        // pages) are at least the longest key plus value any sound writer produces, plus
        // etcd's framing: the longest names, rank and world, address and fingerprint list.
        let longest = |prefix: &str| format!("{prefix}{}", "z".repeat(NAME_BYTES_MAX - prefix.len()));
        let cluster = ClusterId::new(&longest("c")).unwrap();
        let node = NodeId::new(&longest("n")).unwrap();
        let layout = KeyLayout::new(cluster.clone());
        let record = SegmentRecord {
            node: node.clone(),
            space: ModelSpace::new([0xff; 32], 1023, 1024).unwrap(),
            key: SegmentKey::new(u64::MAX).unwrap(),
            index: u32::MAX,
            segment_blocks: SegmentBlocks::new(SegmentBlocks::MAX).unwrap(),
        };
        let key = layout.segment_key(&record.space, record.key, &node);
        let value = record.encode(&cluster);
        assert_eq!((key.len(), value.len()), (SEGMENT_KEY_BYTES_MAX, SEGMENT_VALUE_BYTES_MAX));
        assert!(key.len() + value.len() + ENTRY_FRAMING_BYTES <= SEGMENT_ENTRY_BYTES_MAX);
        let member = MemberRecord {
            node: node.clone(),
            key_secret_tag: KeySecretTag::new([0xff; KEY_SECRET_TAG_BYTES]),
            address: "a".repeat(ADDRESS_BYTES_MAX),
            capacity_bytes: u64::MAX,
            fingerprints: vec![[1; 32]; FINGERPRINTS_MAX],
        };
        let (key, value) = (layout.member_key(&node), member.encode(&cluster).unwrap());
        assert_eq!((key.len(), value.len()), (MEMBER_KEY_BYTES_MAX, MEMBER_VALUE_BYTES_MAX));
        assert!(key.len() + value.len() + ENTRY_FRAMING_BYTES <= MEMBER_ENTRY_BYTES_MAX);
    }
}
