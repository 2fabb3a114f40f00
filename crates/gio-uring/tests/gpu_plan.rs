//! The CUDA executor's translation of a detached queue pair into the kernel's state, checked
//! against the software controller without a GPU: the CPU plays the kernel for one command,
//! using only the addresses the state image holds (host addresses stand in for GPU addresses,
//! as `cuMemHostGetDevicePointer` would map them one to one). If a doorbell offset, a ring
//! address or the initial phase were wrong, the controller would never complete the command.
#![cfg(feature = "cuda")]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gio_uring::abi::{gio_nvme_qp, gio_nvme_slot};
use gio_uring::gpu::plan::{self, StateLayout};
use nvme_driver::hw::DeviceBackend;
use nvme_driver::spec::{CompletionEntry, SubmissionEntry, COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::{CommandId, Controller, ControllerConfig, DmaRegion, Lba};
use nvme_emu::{Backing, EmuConfig, EmuDevice, NamespaceConfig};

fn u64_at(image: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(image[at..at + 8].try_into().unwrap())
}

fn u32_at(image: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(image[at..at + 4].try_into().unwrap())
}

/// The region byte offset of "GPU address" `address` inside `region` (identity mapping).
fn offset_in(region: &DmaRegion, address: u64) -> usize {
    let offset = address.checked_sub(region.host_address() as u64).expect("address below the region");
    assert!(offset < region.len() as u64, "address past the region");
    offset as usize
}

#[test]
fn the_state_image_drives_a_detached_queue_pair_of_the_software_controller() {
    let config = EmuConfig::default()
        .with_backing(Backing::Memory { bytes: 1 << 20 })
        .with_namespaces(vec![NamespaceConfig::new(512, Some(1 << 20))]);
    let device = EmuDevice::start(config).unwrap();
    let backend: Arc<dyn DeviceBackend> = device.clone();
    let controller = Controller::init(backend, ControllerConfig::default()).unwrap();
    let namespace = controller.namespaces()[0];
    // A queue pair the host drives, so that the detached one gets a queue id above 1.
    let _other = controller.create_io_queue_pair(4).unwrap();
    let depth = 8u32;
    let submission = controller.dma().allocate(depth as usize * SUBMISSION_ENTRY_BYTES).unwrap();
    let completion = controller.dma().allocate(depth as usize * COMPLETION_ENTRY_BYTES).unwrap();
    let pair = controller.create_detached_queue_pair(depth, Some((submission.clone(), completion.clone()))).unwrap();
    let bar = device.register_region();
    let rings = (submission.host_address() as u64, completion.host_address() as u64);
    let addresses = plan::queue_pair_addresses(&pair.layout(), rings, bar.host_address() as u64, bar.len()).unwrap();
    let layout = StateLayout::new(&[depth]);
    let image = plan::state_image(&layout, &[addresses], 0x1000_0000);

    // Play the kernel for ticket 0 from the image alone.
    let qp = StateLayout::qp_offset(0);
    let sq_entries = u64_at(&image, qp + core::mem::offset_of!(gio_nvme_qp, sq_entries));
    let cq_entries = u64_at(&image, qp + core::mem::offset_of!(gio_nvme_qp, cq_entries));
    let sq_doorbell = u64_at(&image, qp + core::mem::offset_of!(gio_nvme_qp, sq_doorbell));
    let cq_doorbell = u64_at(&image, qp + core::mem::offset_of!(gio_nvme_qp, cq_doorbell));
    let sq_depth = u32_at(&image, qp + core::mem::offset_of!(gio_nvme_qp, sq_depth));
    let slot0 = layout.slots_offsets_bytes[0];
    let ticket = 0u32;
    assert_eq!(
        u32_at(&image, slot0 + core::mem::offset_of!(gio_nvme_slot, done_ticket)),
        ticket.wrapping_add(1).wrapping_sub(sq_depth),
        "slot 0 is free for ticket 0"
    );
    let buffer = controller.dma().allocate(512).unwrap();
    let mut read = SubmissionEntry::read(namespace.id, Lba(3), nvme_driver::BlockCount::ONE);
    read.set_command_id(CommandId((ticket & 0xFFFF) as u16));
    read.dptr = [buffer.iova().0, 0];
    let slot = (ticket & (sq_depth - 1)) as usize;
    submission.write(offset_in(&submission, sq_entries) + slot * SUBMISSION_ENTRY_BYTES, &read.to_bytes()).unwrap();
    bar.store_u32(offset_in(&bar, sq_doorbell), (ticket + 1) & (sq_depth - 1), Ordering::Release).unwrap();

    // The completion arrives in slot 0 of the CQ the image names, with phase 1.
    let cq = offset_in(&completion, cq_entries);
    let deadline = Instant::now() + Duration::from_secs(5);
    let entry = loop {
        let dword3 = completion.load_u32(cq + CompletionEntry::DWORD3_OFFSET, Ordering::Acquire).unwrap();
        if CompletionEntry::decode_dword3(dword3).2 {
            let mut bytes = [0u8; 16];
            completion.read(cq, &mut bytes).unwrap();
            break CompletionEntry::from_bytes(&bytes);
        }
        assert!(Instant::now() < deadline, "no completion: the image's SQ, doorbell or CQ address is wrong");
        std::thread::yield_now();
    };
    assert_eq!(entry.command_id, 0);
    assert!(entry.status().is_ok(), "{entry:?}");
    bar.store_u32(offset_in(&bar, cq_doorbell), 1, Ordering::Release).unwrap();
    drop(pair);
}
