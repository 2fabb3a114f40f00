//! Deterministic data patterns: every 8-byte word is a function of (seed, byte address on the
//! namespace), so a misplaced block, a stale block or a torn write shows up as a mismatch naming
//! where it is. Within one namespace: another namespace's blocks are told apart only when its
//! seed differs (the checks mix the namespace id into it).

use nvme_driver::DmaRegion;

pub(crate) fn mix(mut value: u64) -> u64 {
    // splitmix64 finaliser: cheap and every input bit affects every output bit.
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

fn pattern_bytes(seed: u64, disk_offset_bytes: u64, len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(len);
    let mut word_address = disk_offset_bytes / 8;
    while bytes.len() < len {
        let word = mix(seed ^ word_address.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let take = (len - bytes.len()).min(8);
        bytes.extend_from_slice(&word.to_le_bytes()[..take]);
        word_address += 1;
    }
    bytes
}

/// Fills `len` bytes of `region` at `offset` with the pattern for `disk_offset_bytes`.
pub fn fill_pattern(region: &DmaRegion, offset: usize, len: usize, seed: u64, disk_offset_bytes: u64) -> Result<(), nvme_driver::HwError> {
    region.write(offset, &pattern_bytes(seed, disk_offset_bytes, len))
}

/// Checks that `len` bytes of `region` at `offset` hold the pattern for `disk_offset_bytes`;
/// on mismatch, names the first differing byte.
pub fn verify_pattern(region: &DmaRegion, offset: usize, len: usize, seed: u64, disk_offset_bytes: u64) -> Result<(), String> {
    let mut actual = vec![0u8; len];
    region.read(offset, &mut actual).map_err(|error| error.to_string())?;
    let expected = pattern_bytes(seed, disk_offset_bytes, len);
    match actual.iter().zip(&expected).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(index) => Err(format!(
            "data mismatch at disk byte {} (buffer offset {}): expected {:#04x}, found {:#04x}",
            disk_offset_bytes + index as u64,
            offset + index,
            expected[index],
            actual[index]
        )),
    }
}
