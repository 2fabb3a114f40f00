//! The software controller as a conformance target, with its fault injection behind
//! [`FaultInjector`].

use std::sync::Arc;

use nvme_emu::{EmuDevice, FaultAction, FaultPlan, FaultRule};

use crate::FaultInjector;

/// Drives an [`EmuDevice`]'s fault plan: each fault fires on the next I/O command.
pub struct EmuFaults {
    device: Arc<EmuDevice>,
}

impl EmuFaults {
    pub fn new(device: Arc<EmuDevice>) -> Self {
        Self { device }
    }

    fn next_io(&self, action: FaultAction) {
        self.device.set_faults(FaultPlan::none().with_rule(FaultRule::on_nth_io(1, action)));
    }
}

impl FaultInjector for EmuFaults {
    fn drop_next_completion(&self) {
        self.next_io(FaultAction::DropCompletion);
    }

    fn raise_fatal_status(&self) {
        self.next_io(FaultAction::ControllerFatal);
    }

    fn corrupt_next_command_id(&self) {
        self.next_io(FaultAction::CorruptCommandId);
    }

    fn clear_faults(&self) {
        self.device.set_faults(FaultPlan::none());
    }
}
