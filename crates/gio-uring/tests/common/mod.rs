//! The workload the CPU and GPU end-to-end tests share: 4 layers × 40 IOCTXs of 8 × 512-byte
//! blocks, one IOCB per direction filled once and reissued per layer, LBAs in reverse order.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::time::Duration;

#[cfg(feature = "cuda")]
pub mod gpu_setup;

use gio_uring::abi::Opcode;
use gio_uring::IocbSpec;
use nvme_driver::{Controller, DataSegment, Lba};

pub const BLOCK_BYTES: u32 = 512;
pub const LAYERS: u32 = 4;
/// Blocks per IOCTX (one 4 KiB KV block) and IOCTXs per layer.
pub const BLOCKS_PER_IOCTX: u32 = 8;
pub const IOCTXS: u32 = 40;
pub const LAYER_BYTES: u64 = IOCTXS as u64 * BLOCKS_PER_IOCTX as u64 * BLOCK_BYTES as u64;
pub const LAYER_BLOCKS: u64 = IOCTXS as u64 * BLOCKS_PER_IOCTX as u64;

/// `len` bytes that never repeat at the scale the tests move: byte `i` is byte `i % 8` of
/// splitmix64(`i / 8`). A periodic pattern would let a kernel that moves the wrong IOCTX, or the
/// wrong warp chunk of 32 IOCTXs, pass the byte comparison (the old `(i * 31) ^ (i >> 9)` repeated
/// every 128 KiB, exactly one chunk).
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| splitmix64(i as u64 / 8).to_le_bytes()[i % 8]).collect()
}

/// splitmix64's output function: a bijection on u64, so distinct words differ.
fn splitmix64(word: u64) -> u64 {
    let mut z = word.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The IOCB template: one layer per issue, strides move both the LBAs and the memory.
pub fn layered(opcode: Opcode) -> IocbSpec {
    IocbSpec {
        opcode,
        user_data: 0,
        layer_count: LAYERS,
        lba_stride_blocks: LAYER_BLOCKS,
        mem_stride_bytes: LAYER_BYTES,
        desc_stride_bytes: 0,
    }
}

/// Checks, through a separate CPU queue pair, that the SSD holds IOCTX `i` of layer `L` at LBA
/// `L × LAYER_BLOCKS + (IOCTXS − 1 − i) × BLOCKS_PER_IOCTX`, so a self-consistent but wrong LBA
/// mapping cannot pass.
pub fn assert_ssd_layout(controller: &Controller, data: &[u8]) {
    let namespace = controller.namespaces()[0];
    let mut queue = controller.create_io_queue_pair(16).expect("checking queue pair");
    let block_bytes = (BLOCKS_PER_IOCTX * BLOCK_BYTES) as usize;
    let scratch = controller.dma().allocate(block_bytes).unwrap();
    let mut on_ssd = vec![0u8; block_bytes];
    for layer in 0..LAYERS {
        for i in 0..IOCTXS {
            let lba = u64::from(layer) * LAYER_BLOCKS + u64::from(IOCTXS - 1 - i) * u64::from(BLOCKS_PER_IOCTX);
            let segment = DataSegment::new(scratch.iova(), block_bytes as u32);
            queue.read(namespace.id, Lba(lba), &[segment], Duration::from_secs(5)).unwrap();
            scratch.read(0, &mut on_ssd).unwrap();
            let offset = layer as usize * LAYER_BYTES as usize + i as usize * block_bytes;
            assert!(on_ssd[..] == data[offset..offset + block_bytes], "layer {layer} IOCTX {i} at LBA {lba}");
        }
    }
}

#[cfg(test)]
mod tests {
    // Named in full: gpu.rs, also built with this module, runs without libtest's harness, which
    // drops `#[test]` functions, so a `use super::*` would be an unused import there.
    /// A kernel that reads or writes the wrong IOCTX, or the wrong warp chunk of 32 IOCTXs (the
    /// kernel splits an IOCB into chunks of 32 lanes), must see different bytes: no two 4 KiB
    /// windows of the largest buffer the tests move (204 IOCTXs, gpu.rs's second pass) may be
    /// equal.
    #[test]
    fn no_two_ioctx_windows_of_the_pattern_are_equal() {
        let window = (super::BLOCKS_PER_IOCTX * super::BLOCK_BYTES) as usize;
        let windows = 204;
        let data = super::pattern(window * windows);
        for a in 0..windows {
            for b in a + 1..windows {
                assert!(
                    data[a * window..(a + 1) * window] != data[b * window..(b + 1) * window],
                    "IOCTX windows {a} and {b} hold the same bytes"
                );
            }
        }
    }
}
