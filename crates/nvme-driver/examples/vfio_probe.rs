//! `vfio_probe [BDF...]`: a standalone proof of the VFIO backend.
//!
//! For each NVMe function (default: every PCI function of class 0x010802 bound to vfio-pci) it
//! opens the device through [`VfioDevice`], reads CAP/VS/CSTS through BAR0, allocates and maps
//! DMA memory, brings up the admin queue with raw register and queue-memory writes (on purpose not
//! through the driver's `Controller`, so that this probe isolates the backend), runs Identify
//! Controller into pool memory and again into externally mapped memory, and shuts the controller
//! down. It then does it all a second time after a function-level reset, which also proves that
//! closing the device released the group and every IOMMU mapping.
//!
//! Prints `VFIO_PROBE_OK` and exits 0 only if every step passed on every device.

use std::error::Error;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvme_driver::hw::vfio::{PciAddress, PciSysfs, VfioOptions, VFIO_PCI_DRIVER};
use nvme_driver::hw::{self, DeviceBackend, DmaRegion, RegisterIo, VfioDevice};
use nvme_driver::spec::command::IdentifyCns;
use nvme_driver::spec::registers::{self as reg, Capabilities, ControllerConfiguration, ControllerStatus, ShutdownStatus, Version};
use nvme_driver::spec::{CompletionEntry, IdentifyController, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES};
use nvme_driver::CommandId;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const ADMIN_QUEUE_ENTRIES: u32 = 16;
const PAGE_BYTES: usize = 4096;
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    match run() {
        Ok(()) => {
            println!("VFIO_PROBE_OK");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("vfio_probe: FAILED: {error}");
            println!("VFIO_PROBE_FAIL");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let mut addresses = std::env::args().skip(1).map(|text| text.parse::<PciAddress>()).collect::<std::result::Result<Vec<_>, _>>()?;
    if addresses.is_empty() {
        let sysfs = PciSysfs::default();
        for address in sysfs.devices()? {
            let nvme = sysfs.hex_attribute(address, "class").is_ok_and(|class| class == 0x010802);
            if nvme && sysfs.driver(address)?.as_deref() == Some(VFIO_PCI_DRIVER) {
                addresses.push(address);
            }
        }
    }
    if addresses.is_empty() {
        return Err("no NVMe function bound to vfio-pci (run `tutti bind <BDF>` first)".into());
    }
    for address in addresses {
        let first = probe(address, false)?;
        let second = probe(address, true)?;
        if first != second {
            return Err(format!("{address}: Identify data differs between runs ({first:?} vs {second:?})").into());
        }
    }
    Ok(())
}

/// One full open → bring-up → identify → shutdown → close cycle; returns the model number.
fn probe(address: PciAddress, reset_first: bool) -> Result<String> {
    let started = Instant::now();
    let device = VfioDevice::open_with(address, &VfioOptions::default())?;
    let (base, limit) = device.iova_window();
    println!(
        "{}: group {}, IOVA window {base}..{limit}, IOMMU page sizes {:#x}, mapping slots {:?}, FLR {}",
        device.name(),
        device.iommu_group(),
        device.iommu_info().page_sizes,
        device.iommu_info().mappings_available,
        if device.reset_supported() { "yes" } else { "no" },
    );
    if reset_first {
        if device.reset_supported() {
            device.function_reset()?;
            println!("  function-level reset done");
        } else {
            println!("  function-level reset not offered by this device; skipped");
        }
    }
    let registers = device.registers();
    let cap = Capabilities(registers.read64(reg::CAP));
    let version = Version(registers.read32(reg::VS));
    let status = ControllerStatus(registers.read32(reg::CSTS));
    if status.device_gone() {
        return Err("CSTS reads all ones: the device is not answering".into());
    }
    println!(
        "  CAP={:#018x} (MQES {}, DSTRD {}, TO {} ms) VS={version} CSTS={:#x}",
        cap.0,
        cap.max_queue_entries(),
        cap.doorbell_stride_log2(),
        cap.ready_timeout_ms(),
        status.0
    );

    // Disable, program the admin queue, enable (§3.5.1), with the driver's bounds: CAP.TO for
    // the disable; for the enable CAP.TO, or CRTO.CRWMT when CAP.CRMS.CRWMS says CRTO is there
    // and it is larger (CRWMT is defined for the enable only).
    let crto = cap.ready_with_media_supported().then(|| reg::ReadyTimeouts(registers.read32(reg::CRTO)));
    let enable_timeout = Duration::from_millis(reg::ready_timeout_ms(cap, crto));
    let configuration = ControllerConfiguration(registers.read32(reg::CC));
    registers.write32(reg::CC, configuration.0 & !1);
    wait_ready(&*registers, false, Duration::from_millis(cap.ready_timeout_ms()))?;
    // VFIO opens the function (and leaves it after a reset) with bus mastering off, until the
    // controller was seen stopped; without it the first DMA fails with CSTS.CFS = 1.
    device.enable_bus_master()?;

    let dma = device.dma();
    let memory = dma.allocate(3 * PAGE_BYTES)?;
    let submission_queue = memory.subregion(0, PAGE_BYTES)?;
    let completion_queue = memory.subregion(PAGE_BYTES, PAGE_BYTES)?;
    let identify_buffer = memory.subregion(2 * PAGE_BYTES, PAGE_BYTES)?;
    println!("  DMA: {} bytes at {}", memory.len(), memory.iova());

    registers.write32(reg::INTMS, u32::MAX); // we poll; no interrupts
    registers.write32(reg::AQA, reg::admin_queue_attributes(ADMIN_QUEUE_ENTRIES, ADMIN_QUEUE_ENTRIES));
    registers.write64(reg::ASQ, submission_queue.iova().0);
    registers.write64(reg::ACQ, completion_queue.iova().0);
    registers.write32(reg::CC, ControllerConfiguration::for_enable().0);
    wait_ready(&*registers, true, enable_timeout)?;

    let mut admin =
        AdminQueue { submission_queue, completion_queue, tail: 0, head: 0, phase: true, next_id: 1, stride: cap.doorbell_stride_log2() };
    admin.run(&*registers, SubmissionEntry::identify(IdentifyCns::Controller, 0, identify_buffer.iova().0))?;
    let mut bytes = vec![0u8; IDENTIFY_BYTES];
    identify_buffer.read(0, &mut bytes)?;
    let identify = IdentifyController::parse(&bytes)?;
    println!(
        "  Identify Controller: model '{}' serial '{}' firmware '{}' MDTS {} SGLS {:#x} namespaces {}",
        identify.model_number,
        identify.serial_number,
        identify.firmware_revision,
        identify.mdts,
        identify.sgl_support.0,
        identify.namespace_count
    );

    // The same command into memory the caller owns, registered with map_external.
    let external = ExternalPage::new()?;
    // SAFETY: `external` is a live, page-aligned 4 KiB allocation that outlives `mapped` (dropped
    // first, below), and no Rust reference into it exists while the device writes it.
    let mapped = unsafe { dma.map_external(external.pointer, PAGE_BYTES)? };
    if let Err(error) = admin.run(&*registers, SubmissionEntry::identify(IdentifyCns::Controller, 0, mapped.iova().0)) {
        // The command may still write the page: unmap it, and never free it, since an unmap
        // that fails keeps the mapping (the driver's rule: memory a device may write leaks).
        drop(mapped);
        std::mem::forget(external);
        return Err(error);
    }
    let mut external_bytes = vec![0u8; IDENTIFY_BYTES];
    mapped.read(0, &mut external_bytes)?;
    drop(mapped);
    if external_bytes != bytes {
        return Err("Identify into externally mapped memory differs from Identify into pool memory".into());
    }
    println!("  Identify into map_external memory matches");

    // Orderly shutdown (§3.6.2) so the next open finds a quiet controller.
    let configuration = registers.read32(reg::CC);
    registers.write32(reg::CC, configuration & !(0x3 << 14) | 1 << 14);
    let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
    while ControllerStatus(registers.read32(reg::CSTS)).shutdown() != ShutdownStatus::Complete {
        if Instant::now() > deadline {
            return Err("shutdown did not complete (CSTS.SHST)".into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    println!("  shutdown complete; cycle took {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    Ok(identify.model_number)
}

fn wait_ready(registers: &dyn RegisterIo, ready: bool, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let status = ControllerStatus(registers.read32(reg::CSTS));
        if status.device_gone() {
            return Err("CSTS reads all ones while waiting for RDY".into());
        }
        if status.fatal() {
            return Err(format!("CSTS.CFS=1 while waiting for RDY={} (bus mastering off?)", u8::from(ready)).into());
        }
        if status.ready() == ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("CSTS.RDY did not become {} within {timeout:?}", u8::from(ready)).into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The admin queue pair, just enough for one command at a time.
struct AdminQueue {
    submission_queue: DmaRegion,
    completion_queue: DmaRegion,
    tail: u32,
    head: u32,
    phase: bool,
    next_id: u16,
    stride: u8,
}

impl AdminQueue {
    fn run(&mut self, registers: &dyn RegisterIo, mut command: SubmissionEntry) -> Result<()> {
        let id = CommandId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        command.set_command_id(id);
        self.submission_queue.write(self.tail as usize * 64, &command.to_bytes())?;
        self.tail = (self.tail + 1) % ADMIN_QUEUE_ENTRIES;
        // The entry must be in memory before the doorbell write makes the controller fetch it.
        // A SeqCst fence orders memory for other threads only: on Arm it does not wait for the
        // stores to reach a device (see the driver's fence for why).
        hw::fence_before_submission_doorbell();
        registers.write32(reg::doorbell_offset(0, false, self.stride), self.tail);

        let slot = self.head as usize * COMPLETION_ENTRY_BYTES;
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        loop {
            let dword3 = self.completion_queue.load_u32(slot + CompletionEntry::DWORD3_OFFSET, Ordering::Acquire)?;
            let (_, _, phase) = CompletionEntry::decode_dword3(dword3);
            if phase == self.phase {
                break;
            }
            if Instant::now() > deadline {
                let status = registers.read32(reg::CSTS);
                return Err(format!("admin {id} (opcode {:#04x}) timed out; CSTS={status:#x}", command.opcode()).into());
            }
            std::hint::spin_loop();
        }
        // The Acquire load of dword 3 does not order the body's loads after it for a device's
        // writes on Arm: without this the body (command id included, which from_bytes takes
        // from the copy) could be the slot's previous lap (see the driver's fence for why).
        hw::fence_after_completion_phase();
        let mut bytes = [0u8; COMPLETION_ENTRY_BYTES];
        self.completion_queue.read(slot, &mut bytes)?;
        let completion = CompletionEntry::from_bytes(&bytes);
        self.head = (self.head + 1) % ADMIN_QUEUE_ENTRIES;
        if self.head == 0 {
            self.phase = !self.phase;
        }
        // The entry is read (above) before the head doorbell hands its slot back to the
        // controller, which may then overwrite it.
        hw::fence_before_completion_doorbell();
        registers.write32(reg::doorbell_offset(0, true, self.stride), self.head);
        if completion.command_id() != id {
            return Err(format!("completion for {} while waiting for {id}", completion.command_id()).into());
        }
        completion.status().map_err(|status| format!("admin {id} (opcode {:#04x}) failed: {status}", command.opcode()))?;
        Ok(())
    }
}

/// One page of memory this program owns (standing in for an engine's buffer).
struct ExternalPage {
    pointer: *mut u8,
}

impl ExternalPage {
    fn layout() -> std::alloc::Layout {
        // 4096 is a power of two and non-zero: this cannot fail.
        std::alloc::Layout::from_size_align(PAGE_BYTES, PAGE_BYTES).expect("page layout")
    }

    fn new() -> Result<Self> {
        // SAFETY: the layout has non-zero size.
        let pointer = unsafe { std::alloc::alloc_zeroed(Self::layout()) };
        if pointer.is_null() {
            return Err("out of memory".into());
        }
        Ok(Self { pointer })
    }
}

impl Drop for ExternalPage {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout and not freed since.
        unsafe { std::alloc::dealloc(self.pointer, Self::layout()) }
    }
}
