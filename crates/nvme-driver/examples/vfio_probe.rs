//! `vfio_probe [BDF...]`: a standalone proof of the VFIO backend.
//!
//! For each NVMe function (default: every PCI function of class 0x010802 bound to vfio-pci) it
//! opens the device through [`VfioDevice`], reads CAP/VS/CSTS through BAR0, allocates and maps
//! DMA memory, brings up the admin queue with raw register and queue-memory writes (on purpose not
//! through the driver's `Controller`, so that this probe isolates the backend), runs Identify
//! Controller into pool memory and again into externally mapped memory, shuts the controller
//! down and disables it. It then does it all a second time after a function-level reset, which
//! also proves that closing the device released the group and every IOMMU mapping.
//!
//! It keeps the driver's rule for memory a device may write: none of the probe's DMA memory is
//! unmapped until the controller was seen stopped (CSTS.RDY = 0 after CC.EN = 0), on error paths
//! too; if it never stops, the memory is leaked.
//!
//! Prints `VFIO_PROBE_OK` and exits 0 only if every step passed on every device.

use std::error::Error;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvme_driver::hw::vfio::{PciAddress, PciSysfs, VfioOptions, VFIO_PCI_DRIVER};
use nvme_driver::hw::{self, DeviceBackend, DmaAllocator, DmaRegion, RegisterIo, VfioDevice};
use nvme_driver::spec::command::IdentifyCns;
use nvme_driver::spec::registers::{self as reg, Capabilities, ControllerConfiguration, ControllerStatus, ShutdownStatus, Version};
use nvme_driver::spec::{CompletionEntry, IdentifyController, SubmissionEntry, COMPLETION_ENTRY_BYTES, IDENTIFY_BYTES};
use nvme_driver::CommandId;

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const ADMIN_QUEUE_ENTRIES: u32 = 16;
const PAGE_BYTES: usize = 4096;

/// How long the probe waits for one admin command and for the shutdown (tests shorten them).
pub struct Bounds {
    pub command: Duration,
    pub shutdown: Duration,
}

const BOUNDS: Bounds = Bounds { command: Duration::from_secs(5), shutdown: Duration::from_secs(5) };

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
    let enable_bus_master = || device.enable_bus_master().map_err(Into::into);
    let model = identify_controller(&*device.registers(), &*device.dma(), &enable_bus_master, &BOUNDS)?;
    println!("  cycle took {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    Ok(model)
}

/// Brings the controller behind `registers` up with an admin queue in `dma` memory, runs
/// Identify Controller into pool memory and into externally mapped memory, shuts the controller
/// down and disables it; returns the model number. `enable_bus_master` is called once the
/// controller was seen stopped, before it may DMA. The memory is unmapped only once the
/// controller was seen stopped again, whatever failed; if it does not stop, it is leaked.
pub fn identify_controller(
    registers: &dyn RegisterIo,
    dma: &dyn DmaAllocator,
    enable_bus_master: &dyn Fn() -> Result<()>,
    bounds: &Bounds,
) -> Result<String> {
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
    // and it is larger (CRWMT is defined for the enable only). An enable found under way (an
    // earlier process's) gets the enable bound to finish before it is cleared.
    let crto = cap.ready_with_media_supported().then(|| reg::ReadyTimeouts(registers.read32(reg::CRTO)));
    let enable_timeout = Duration::from_millis(reg::ready_timeout_ms(cap, crto));
    let disable_timeout = Duration::from_millis(cap.ready_timeout_ms());
    stop(registers, enable_timeout, disable_timeout)?;
    // VFIO opens the function (and leaves it after a reset) with bus mastering off, until the
    // controller was seen stopped; without it the first DMA fails with CSTS.CFS = 1.
    enable_bus_master()?;

    // Everything the controller is told about exists before it is enabled, and goes only after
    // it was seen to stop again (below): the admin queue, the Identify buffer, and a page the
    // caller owns, registered with map_external (standing in for an engine's buffer).
    let memory = dma.allocate(3 * PAGE_BYTES)?;
    let external = ExternalPage::new()?;
    // SAFETY: `external` is a live, page-aligned 4 KiB allocation that outlives `mapped` (which
    // is unmapped first below, or both are leaked), and no Rust reference into it exists while
    // the device may write it.
    let mapped = unsafe { dma.map_external(external.pointer, PAGE_BYTES)? };
    println!("  DMA: {} bytes at {}, and one external page at {}", memory.len(), memory.iova(), mapped.iova());

    registers.write32(reg::INTMS, u32::MAX); // we poll; no interrupts
    registers.write32(reg::AQA, reg::admin_queue_attributes(ADMIN_QUEUE_ENTRIES, ADMIN_QUEUE_ENTRIES));
    registers.write64(reg::ASQ, memory.iova().0);
    registers.write64(reg::ACQ, memory.iova().0 + PAGE_BYTES as u64);
    registers.write32(reg::CC, ControllerConfiguration::for_enable().0);
    let outcome = identify_and_shut_down(registers, cap, &memory, &mapped, enable_timeout, bounds);

    // Whatever happened, the controller is stopped before its memory may go: a command that
    // timed out may still write its buffer, and a dropped region's IOVA goes back to the pool
    // for reuse. The shutdown above is not that: only CSTS.RDY = 0 after CC.EN = 0 says the
    // controller stopped. (On an error path this disables without a shutdown: the probe wrote
    // no data, so there is nothing for the drive to commit.) Our own enable has had its whole
    // bound, so one still under way gets CAP.TO more, as in the driver's teardown.
    if let Err(stop_error) = stop(registers, disable_timeout, disable_timeout) {
        // It may still write any of it: keep it all for the rest of the process (the driver's
        // rule). The external page is never freed either: an IOVA that stays mapped reaches it.
        let kept = memory.leak() + mapped.leak();
        std::mem::forget(external);
        let before = match &outcome {
            Ok(_) => String::new(),
            Err(error) => format!("{error}; then "),
        };
        return Err(format!("{before}the controller did not stop ({stop_error}): its {kept} bytes of DMA memory are kept (leaked)").into());
    }
    // Unmapped before the page behind it is freed.
    drop(mapped);
    drop(external);
    drop(memory);
    println!("  controller stopped (CSTS.RDY = 0)");
    outcome
}

/// The probe's steps with the controller enabled: waits for CSTS.RDY = 1, runs Identify
/// Controller into pool memory (`memory`: admin SQ, CQ and Identify buffer, a page each) and
/// into `mapped`, compares them, and shuts the controller down (§3.6.2) so that the drive
/// commits its state. Returns the model number. The caller stops the controller afterwards,
/// whatever this returns.
fn identify_and_shut_down(
    registers: &dyn RegisterIo,
    cap: Capabilities,
    memory: &DmaRegion,
    mapped: &DmaRegion,
    enable_timeout: Duration,
    bounds: &Bounds,
) -> Result<String> {
    wait_ready(registers, true, enable_timeout)?;
    let identify_buffer = memory.subregion(2 * PAGE_BYTES, PAGE_BYTES)?;
    let mut admin = AdminQueue {
        submission_queue: memory.subregion(0, PAGE_BYTES)?,
        completion_queue: memory.subregion(PAGE_BYTES, PAGE_BYTES)?,
        tail: 0,
        head: 0,
        phase: true,
        next_id: 1,
        stride: cap.doorbell_stride_log2(),
        timeout: bounds.command,
    };
    admin.run(registers, SubmissionEntry::identify(IdentifyCns::Controller, 0, identify_buffer.iova().0))?;
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
    admin.run(registers, SubmissionEntry::identify(IdentifyCns::Controller, 0, mapped.iova().0))?;
    let mut external_bytes = vec![0u8; IDENTIFY_BYTES];
    mapped.read(0, &mut external_bytes)?;
    if external_bytes != bytes {
        return Err("Identify into externally mapped memory differs from Identify into pool memory".into());
    }
    println!("  Identify into map_external memory matches");

    // Orderly shutdown (§3.6.2) so the next open finds a quiet controller.
    let configuration = registers.read32(reg::CC);
    registers.write32(reg::CC, configuration & !(0x3 << 14) | 1 << 14);
    let deadline = Instant::now() + bounds.shutdown;
    while ControllerStatus(registers.read32(reg::CSTS)).shutdown() != ShutdownStatus::Complete {
        if Instant::now() > deadline {
            return Err("shutdown did not complete (CSTS.SHST)".into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    println!("  shutdown complete");
    Ok(identify.model_number)
}

/// Clears CC.EN and waits up to `disable_timeout` (CAP.TO) for CSTS.RDY = 0: only then has the
/// controller stopped touching memory. A controller found in the middle of an enable (CC.EN = 1,
/// CSTS.RDY = 0, no fatal status) first gets up to `settle_timeout` to finish it, as the
/// driver's `settle_enable` does: the spec leaves clearing EN then undefined, and RDY = 0 right
/// after the clear could be the enable not yet done rather than the reset done.
fn stop(registers: &dyn RegisterIo, settle_timeout: Duration, disable_timeout: Duration) -> Result<()> {
    let configuration = ControllerConfiguration(registers.read32(reg::CC));
    let status = ControllerStatus(registers.read32(reg::CSTS));
    if configuration.enabled() && !status.ready() && !status.fatal() {
        if let Err(error) = wait_ready(registers, true, settle_timeout) {
            // One that turned fatal meanwhile will not become ready: clearing EN is its reset.
            if !ControllerStatus(registers.read32(reg::CSTS)).fatal() {
                return Err(format!("an enable under way did not finish: {error}").into());
            }
        }
    }
    let configuration = registers.read32(reg::CC);
    registers.write32(reg::CC, configuration & !1);
    wait_ready(registers, false, disable_timeout)
}

/// Waits up to `timeout` for CSTS.RDY to equal `ready`. A fatal status (CSTS.CFS) fails a wait
/// for RDY = 1 at once; a wait for RDY = 0 goes on, since clearing CC.EN is what resets a
/// controller in that state.
fn wait_ready(registers: &dyn RegisterIo, ready: bool, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let status = ControllerStatus(registers.read32(reg::CSTS));
        if status.device_gone() {
            return Err("CSTS reads all ones while waiting for RDY".into());
        }
        if ready && status.fatal() {
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
    timeout: Duration,
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
        let deadline = Instant::now() + self.timeout;
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
