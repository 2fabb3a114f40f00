//! Controller registers (§3.1.3): offsets and typed views of CAP, VS, CC, CSTS, AQA, CRTO.

/// Controller Capabilities, 64-bit.
pub const CAP: usize = 0x00;
/// Version, 32-bit.
pub const VS: usize = 0x08;
/// Interrupt Mask Set / Clear (unused: the driver polls).
pub const INTMS: usize = 0x0C;
pub const INTMC: usize = 0x10;
/// Controller Configuration, 32-bit.
pub const CC: usize = 0x14;
/// Controller Status, 32-bit.
pub const CSTS: usize = 0x1C;
/// NVM Subsystem Reset.
pub const NSSR: usize = 0x20;
/// Admin Queue Attributes, 32-bit.
pub const AQA: usize = 0x24;
/// Admin Submission Queue base address, 64-bit.
pub const ASQ: usize = 0x28;
/// Admin Completion Queue base address, 64-bit.
pub const ACQ: usize = 0x30;
/// Controller Ready Timeouts, 32-bit (NVMe 2.0; see [`ReadyTimeouts`]).
pub const CRTO: usize = 0x68;
/// First doorbell register (§3.1.3.24).
pub const DOORBELL_BASE: usize = 0x1000;

/// Byte offset of a queue's doorbell: SQ y tail at 0x1000 + (2y)·(4 << DSTRD), CQ y head at
/// 0x1000 + (2y+1)·(4 << DSTRD) (§3.1.3.24, §3.1.3.25).
pub fn doorbell_offset(queue_id: u16, completion: bool, doorbell_stride_log2: u8) -> usize {
    let index = 2 * queue_id as usize + usize::from(completion);
    DOORBELL_BASE + index * (4usize << doorbell_stride_log2)
}

/// Byte offset of a queue's slot in the shadow doorbell and EventIdx pages of Doorbell Buffer
/// Config (§5.7): the doorbell's own offset less the doorbell base, the same stride.
pub fn shadow_doorbell_offset(queue_id: u16, completion: bool, doorbell_stride_log2: u8) -> usize {
    doorbell_offset(queue_id, completion, doorbell_stride_log2) - DOORBELL_BASE
}

/// Whether a host that moved a shadow doorbell from `old` to `new` must also write the MMIO
/// doorbell (§5.7): the controller asked, through the EventIdx `event_index`, to be told once
/// the value passes it, and it did in this step (`event_index` lies in `[old, new)`, that window
/// taken across the wrap when `new < old`: the 16-bit arithmetic is exact for any queue depth).
/// A host that skips the write leaves the controller to find `new` in the shadow page itself.
pub fn doorbell_event_needed(event_index: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event_index).wrapping_sub(1) < new.wrapping_sub(old)
}

/// CAP (§3.1.3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities(pub u64);

impl Capabilities {
    /// cap.mqes: maximum entries per queue, 0's based (returned here as a count).
    pub fn max_queue_entries(self) -> u32 {
        (self.0 & 0xFFFF) as u32 + 1
    }
    /// cap.cqr: contiguous queues required.
    pub fn contiguous_queues_required(self) -> bool {
        self.0 >> 16 & 1 == 1
    }
    /// cap.to: worst-case time for CSTS.RDY to change, in 500 ms units.
    pub fn timeout_500ms_units(self) -> u8 {
        (self.0 >> 24 & 0xFF) as u8
    }
    /// cap.to in milliseconds (at least 500 ms, so a controller reporting 0 still gets a bound).
    /// The driver's bound for every wait for CSTS.RDY = 0 after CC.EN = 0, and the floor of its
    /// shutdown bound. For CSTS.RDY = 1 after CC.EN = 1, a controller with
    /// [`Capabilities::ready_with_media_supported`] may give a longer bound in CRTO, which
    /// [`ready_timeout_ms`] takes into account.
    pub fn ready_timeout_ms(self) -> u64 {
        u64::from(self.timeout_500ms_units().max(1)) * 500
    }
    /// cap.crms.crwms (bit 59, NVMe 2.0): Controller Ready With Media Support. When set, CRTO
    /// is implemented and CRTO.CRWMT bounds the enable (CC.CRIME = 0), while CAP.TO may be a
    /// saturated or smaller figure.
    pub fn ready_with_media_supported(self) -> bool {
        self.0 >> 59 & 1 == 1
    }
    /// cap.dstrd: doorbell stride as a power of two over 4 bytes.
    pub fn doorbell_stride_log2(self) -> u8 {
        (self.0 >> 32 & 0xF) as u8
    }
    /// cap.nssrs: NVM subsystem reset supported.
    pub fn subsystem_reset_supported(self) -> bool {
        self.0 >> 36 & 1 == 1
    }
    /// cap.css bit 0: NVM command set supported.
    pub fn nvm_command_set_supported(self) -> bool {
        self.0 >> 37 & 1 == 1
    }
    /// cap.mpsmin: minimum memory page size, 2^(12 + mpsmin).
    pub fn min_page_size_bytes(self) -> u64 {
        1u64 << (12 + (self.0 >> 48 & 0xF))
    }
    /// cap.mpsmax: maximum memory page size, 2^(12 + mpsmax).
    pub fn max_page_size_bytes(self) -> u64 {
        1u64 << (12 + (self.0 >> 52 & 0xF))
    }

    /// Builds a CAP value (for the software controller).
    pub fn build(max_queue_entries: u32, timeout_500ms_units: u8, doorbell_stride_log2: u8, mpsmin: u8, mpsmax: u8) -> Self {
        let mqes = u64::from(max_queue_entries.clamp(2, 65536) - 1);
        let value = mqes
            | 1 << 16 // CQR: queues must be physically contiguous.
            | u64::from(timeout_500ms_units) << 24
            | u64::from(doorbell_stride_log2 & 0xF) << 32
            | 1 << 37 // CSS: NVM command set.
            | u64::from(mpsmin & 0xF) << 48
            | u64::from(mpsmax & 0xF) << 52;
        Self(value)
    }
}

/// CRTO (NVMe 2.0, Controller Ready Timeouts): how long CSTS.RDY may take to become 1 after
/// CC.EN does, by CC.CRIME. Implemented when [`Capabilities::ready_with_media_supported`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyTimeouts(pub u32);

impl ReadyTimeouts {
    /// crto.crwmt (bits 15:0): Controller Ready With Media Timeout, in 500 ms units: the bound
    /// with CC.CRIME = 0 (the driver's setting: RDY only once the media is ready too).
    pub fn with_media_500ms_units(self) -> u16 {
        (self.0 & 0xFFFF) as u16
    }
    /// crto.crimt (bits 31:16): Controller Ready Independent of Media Timeout, in 500 ms units:
    /// the bound with CC.CRIME = 1 (unused: the driver keeps CRIME = 0).
    pub fn independent_of_media_500ms_units(self) -> u16 {
        (self.0 >> 16) as u16
    }
}

/// The enable bound: how long the driver waits for CSTS.RDY to become 1 after setting CC.EN
/// (CC.CRIME = 0), in milliseconds: CAP.TO, or, when
/// CAP.CRMS.CRWMS is set and `ready_timeouts` is CRTO as read then, the larger of CAP.TO and
/// CRTO.CRWMT (at most 65535 × 500 ms, about 9.1 hours, the field's range). The larger, as Linux
/// takes it (`nvme_enable_ctrl`): CRTO should be at least CAP.TO, but some devices report less,
/// or 0. At least 500 ms, as [`Capabilities::ready_timeout_ms`]. Only for RDY 0 → 1, the one
/// transition CRWMT is defined for: a disable's wait is CAP.TO alone, as Linux's
/// `nvme_disable_ctrl` has it, so a drive that never stops is not waited for up to 9 hours.
pub fn ready_timeout_ms(capabilities: Capabilities, ready_timeouts: Option<ReadyTimeouts>) -> u64 {
    let with_media_ms = match ready_timeouts {
        Some(crto) if capabilities.ready_with_media_supported() => u64::from(crto.with_media_500ms_units()) * 500,
        _ => 0,
    };
    capabilities.ready_timeout_ms().max(with_media_ms)
}

/// VS (§3.1.3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version(pub u32);

impl Version {
    pub const V1_4: Version = Version(0x0001_0400);
    pub fn major(self) -> u16 {
        (self.0 >> 16) as u16
    }
    pub fn minor(self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub fn tertiary(self) -> u8 {
        self.0 as u8
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major(), self.minor(), self.tertiary())
    }
}

/// CC (§3.1.3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ControllerConfiguration(pub u32);

/// cc.shn values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownNotification {
    None,
    Normal,
    Abrupt,
}

impl ControllerConfiguration {
    /// cc.en
    pub fn enabled(self) -> bool {
        self.0 & 1 == 1
    }
    /// cc.css: I/O command set selected (0 = NVM).
    pub fn command_set(self) -> u8 {
        (self.0 >> 4 & 0x7) as u8
    }
    /// cc.mps: memory page size, 2^(12 + mps).
    pub fn page_size_bytes(self) -> u64 {
        1u64 << (12 + (self.0 >> 7 & 0xF))
    }
    /// cc.ams: arbitration mechanism.
    pub fn arbitration(self) -> u8 {
        (self.0 >> 11 & 0x7) as u8
    }
    /// cc.shn
    pub fn shutdown(self) -> ShutdownNotification {
        match self.0 >> 14 & 0x3 {
            0 => ShutdownNotification::None,
            1 => ShutdownNotification::Normal,
            _ => ShutdownNotification::Abrupt,
        }
    }
    /// cc.iosqes: I/O submission entry size, 2^n bytes.
    pub fn io_submission_entry_size_log2(self) -> u8 {
        (self.0 >> 16 & 0xF) as u8
    }
    /// cc.iocqes: I/O completion entry size, 2^n bytes.
    pub fn io_completion_entry_size_log2(self) -> u8 {
        (self.0 >> 20 & 0xF) as u8
    }

    /// The configuration the driver enables with: NVM command set, 4 KiB pages, round robin,
    /// 64-byte SQ entries and 16-byte CQ entries.
    pub fn for_enable() -> Self {
        Self(1 | 6 << 16 | 4 << 20)
    }
}

/// CSTS (§3.1.3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerStatus(pub u32);

/// csts.shst values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownStatus {
    /// 00b: no shutdown requested.
    Normal,
    /// 01b: shutdown processing occurring.
    Occurring,
    /// 10b: shutdown processing complete.
    Complete,
    /// 11b: reserved. Not complete: a host waiting for a shutdown keeps waiting (to its bound)
    /// rather than disabling a controller that may still be writing back its cache.
    Reserved,
}

impl ControllerStatus {
    /// csts.rdy
    pub fn ready(self) -> bool {
        self.0 & 1 == 1
    }
    /// csts.cfs: controller fatal status.
    pub fn fatal(self) -> bool {
        self.0 >> 1 & 1 == 1
    }
    /// csts.shst
    pub fn shutdown(self) -> ShutdownStatus {
        match self.0 >> 2 & 0x3 {
            0 => ShutdownStatus::Normal,
            1 => ShutdownStatus::Occurring,
            2 => ShutdownStatus::Complete,
            _ => ShutdownStatus::Reserved,
        }
    }
    /// All ones: the read did not reach a device (surprise removal, dead link).
    pub fn device_gone(self) -> bool {
        self.0 == u32::MAX
    }
}

/// AQA (§3.1.3.7): admin queue sizes, 0's based.
pub fn admin_queue_attributes(submission_entries: u32, completion_entries: u32) -> u32 {
    (submission_entries - 1) & 0xFFF | ((completion_entries - 1) & 0xFFF) << 16
}

/// Decodes AQA into (submission entries, completion entries).
pub fn decode_admin_queue_attributes(aqa: u32) -> (u32, u32) {
    ((aqa & 0xFFF) + 1, (aqa >> 16 & 0xFFF) + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doorbells_follow_the_stride() {
        assert_eq!(doorbell_offset(0, false, 0), 0x1000);
        assert_eq!(doorbell_offset(0, true, 0), 0x1004);
        assert_eq!(doorbell_offset(3, true, 0), 0x101C);
        assert_eq!(doorbell_offset(1, false, 2), 0x1000 + 2 * 16);
    }

    #[test]
    fn shadow_slots_follow_the_doorbells_and_events_fire_once_passed() {
        assert_eq!(shadow_doorbell_offset(0, false, 0), 0);
        assert_eq!(shadow_doorbell_offset(2, true, 0), 20);
        assert_eq!(shadow_doorbell_offset(1, false, 2), 32);
        // The controller waits at 5: a move from 3 to 6 passes it, 6 to 9 does not, 5 to 6 does.
        assert!(doorbell_event_needed(5, 6, 3));
        assert!(!doorbell_event_needed(5, 9, 6));
        assert!(doorbell_event_needed(5, 6, 5));
        assert!(!doorbell_event_needed(5, 5, 4));
        // A controller behind the host (event 2, before old 3) is still reading: no write.
        assert!(!doorbell_event_needed(2, 6, 3));
        // Indexes wrap at the queue depth (64 here): the window 63..1 holds 63 and 0, not 62 or 10.
        assert!(doorbell_event_needed(0, 1, 63));
        assert!(doorbell_event_needed(63, 1, 63));
        assert!(!doorbell_event_needed(62, 1, 63));
        assert!(!doorbell_event_needed(10, 1, 63));
        // Nothing moved: nothing to tell.
        assert!(!doorbell_event_needed(7, 7, 7));
    }

    #[test]
    fn capabilities_round_trip() {
        let cap = Capabilities::build(2048, 20, 0, 0, 4);
        assert_eq!(cap.max_queue_entries(), 2048);
        assert_eq!(cap.ready_timeout_ms(), 10_000);
        assert_eq!(cap.doorbell_stride_log2(), 0);
        assert_eq!(cap.min_page_size_bytes(), 4096);
        assert_eq!(cap.max_page_size_bytes(), 65536);
        assert!(cap.nvm_command_set_supported());
        assert!(cap.contiguous_queues_required());
        let cc = ControllerConfiguration::for_enable();
        assert!(cc.enabled());
        assert_eq!(cc.page_size_bytes(), 4096);
        assert_eq!(cc.io_submission_entry_size_log2(), 6);
        assert_eq!(cc.io_completion_entry_size_log2(), 4);
        assert_eq!(decode_admin_queue_attributes(admin_queue_attributes(64, 32)), (64, 32));
    }

    #[test]
    fn the_ready_bound_is_cap_to_or_crto_crwmt_when_larger() {
        // Goal: CRTO counts only with CAP.CRMS.CRWMS set; then its CRWMT (bits 15:0, not CRIMT
        // in 31:16) raises the bound above CAP.TO, and never lowers it.
        let crwms = |cap: Capabilities| Capabilities(cap.0 | 1 << 59);
        let cap_to_1 = Capabilities::build(256, 1, 0, 0, 0);
        let crto = |crimt: u32, crwmt: u32| Some(ReadyTimeouts(crimt << 16 | crwmt));
        assert!(!cap_to_1.ready_with_media_supported() && crwms(cap_to_1).ready_with_media_supported());
        assert_eq!(ready_timeout_ms(cap_to_1, crto(0, 6)), 500);
        assert_eq!(ready_timeout_ms(crwms(cap_to_1), crto(0, 6)), 3_000);
        assert_eq!(ready_timeout_ms(crwms(cap_to_1), crto(20, 2)), 1_000);
        assert_eq!(ready_timeout_ms(crwms(cap_to_1), None), 500);
        let cap_to_20 = crwms(Capabilities::build(256, 20, 0, 0, 0));
        assert_eq!(ready_timeout_ms(cap_to_20, crto(0, 0)), 10_000);
        assert_eq!(ready_timeout_ms(cap_to_20, crto(0, 4)), 10_000);
        assert_eq!(ready_timeout_ms(cap_to_20, crto(0, 0xFFFF)), 65_535 * 500);
        assert_eq!(ReadyTimeouts(0x0002_0007).independent_of_media_500ms_units(), 2);
        assert_eq!(ReadyTimeouts(0x0002_0007).with_media_500ms_units(), 7);
    }

    #[test]
    fn every_shutdown_status_decodes_and_only_10b_is_complete() {
        // Goal: the reserved SHST 11b is its own value, not Complete.
        let shst = |bits: u32| ControllerStatus(bits << 2 | 1).shutdown();
        assert_eq!(shst(0), ShutdownStatus::Normal);
        assert_eq!(shst(1), ShutdownStatus::Occurring);
        assert_eq!(shst(2), ShutdownStatus::Complete);
        assert_eq!(shst(3), ShutdownStatus::Reserved);
    }
}
