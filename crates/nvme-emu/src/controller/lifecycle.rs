//! The controller's state machine as CC drives it (§3.5, §3.6, §3.7): enable, controller
//! reset, shutdown notification, and the power loss and function reset the device adds.

use nvme_driver::hw::DmaAllocator;
use nvme_driver::spec::registers::{self, ControllerConfiguration, ShutdownNotification};
use nvme_driver::spec::{COMPLETION_ENTRY_BYTES, SUBMISSION_ENTRY_BYTES};
use nvme_driver::Iova;

use super::in_flight::Settle;
use super::{ControllerCore, State, CSTS_FATAL, CSTS_READY, CSTS_SHUTDOWN_COMPLETE, CSTS_SHUTDOWN_MASK, CSTS_SHUTDOWN_OCCURRING};
use crate::queues::{CompletionQueue, SubmissionQueue};
use crate::{EmuError, PowerLossMode};

impl ControllerCore {
    /// Applies CC: enable (EN 0 to 1), reset (EN 1 to 0), shutdown notification. Called by the
    /// controller thread at every poll, and only there: a host write of CC records an EN = 0
    /// and wakes the thread (see `device.rs`), and returns at once, however long the reset or
    /// shutdown then waits for transfers in flight. CSTS says meanwhile how far it got: RDY
    /// stays 1 until a reset is done, SHST reads 01b while a shutdown is processing.
    pub(crate) fn react_to_configuration(&mut self) -> bool {
        // Every transition below follows a CC write, except finishing a stop and a shutdown
        // that waited for a long zeroing.
        if self.registers.configuration_writes() == self.configuration_seen
            && self.state != State::Stopping
            && !(self.shutdown_awaits_zeroing && self.zeroing.is_none())
        {
            return false;
        }
        // Taken with CC in one step: a host that cleared EN and set it again before this thread
        // looked still gets its reset (the flag), then its enable (CC).
        let (disable_written, cc, writes) = self.registers.take_configuration();
        self.configuration_seen = writes;
        let cc = ControllerConfiguration(cc);
        let mut worked = false;
        if self.state == State::Stopping {
            worked |= self.finish_stopping();
        }
        if matches!(self.state, State::Ready | State::Fatal) && (disable_written || !cc.enabled()) {
            self.reset_controller();
            worked = true;
        }
        if self.state == State::Disabled && cc.enabled() {
            self.enable(cc);
            worked = true;
        }
        worked |= self.handle_shutdown(cc);
        worked
    }

    /// CC.EN 0 to 1 (§3.5.1): checks the configuration and the admin queues, then sets RDY.
    /// A configuration the controller cannot run with sets CSTS.CFS instead.
    fn enable(&mut self, cc: ControllerConfiguration) {
        match self.admin_queues(cc) {
            Ok((submission, completion)) => {
                self.refresh_store_fence();
                self.registers.clear_doorbells();
                self.submission_queues[0] = Some(submission);
                self.completion_queues[0] = Some(completion);
                self.state = State::Ready;
                self.counters.totals.enables += 1;
                self.registers.set_status(CSTS_READY);
            }
            Err(reason) => {
                tracing::warn!(reason, "controller enable failed; setting CSTS.CFS");
                self.set_fatal();
            }
        }
    }

    fn admin_queues(&self, cc: ControllerConfiguration) -> Result<(SubmissionQueue, CompletionQueue), &'static str> {
        if cc.command_set() != 0 {
            return Err("CC.CSS selects a command set other than NVM");
        }
        if cc.page_size_bytes() != 4096 {
            return Err("CC.MPS is not 4 KiB (CAP.MPSMIN = CAP.MPSMAX = 0)");
        }
        let sqes = cc.io_submission_entry_size_log2();
        let cqes = cc.io_completion_entry_size_log2();
        if (sqes != 0 && sqes != 6) || (cqes != 0 && cqes != 4) {
            return Err("CC.IOSQES / CC.IOCQES are not 64 / 16 bytes");
        }
        let (sq_entries, cq_entries) = registers::decode_admin_queue_attributes(self.registers.load32(registers::AQA));
        let max_entries = self.config.max_queue_entries.min(4096);
        if !(2..=max_entries).contains(&sq_entries) || !(2..=max_entries).contains(&cq_entries) {
            return Err("AQA sizes outside 2..=MQES+1");
        }
        let asq = self.registers.load64(registers::ASQ);
        let acq = self.registers.load64(registers::ACQ);
        if asq == 0 || acq == 0 || !asq.is_multiple_of(4096) || !acq.is_multiple_of(4096) {
            return Err("ASQ / ACQ are zero or not page aligned");
        }
        let submission_memory =
            self.dma.translate(Iova(asq), sq_entries as usize * SUBMISSION_ENTRY_BYTES).map_err(|_| "ASQ is not mapped memory")?;
        let completion_memory =
            self.dma.translate(Iova(acq), cq_entries as usize * COMPLETION_ENTRY_BYTES).map_err(|_| "ACQ is not mapped memory")?;
        Ok((SubmissionQueue::new(submission_memory, sq_entries, 0), CompletionQueue::new(completion_memory, cq_entries)))
    }

    pub(super) fn set_fatal(&mut self) {
        self.state = State::Fatal;
        // A fatal controller runs nothing more: a long zeroing under way ends without a
        // completion, as at the reset that must follow (a shutdown must not wait for it).
        self.drop_zeroing();
        let csts = self.registers.load32(registers::CSTS);
        self.registers.set_status(csts | CSTS_FATAL);
    }

    fn drop_queues(&mut self) {
        self.shadow_doorbells = None;
        self.submission_queues.iter_mut().for_each(|queue| *queue = None);
        self.completion_queues.iter_mut().for_each(|queue| *queue = None);
        self.pending.clear();
        if let Some(timing) = self.timing.as_mut() {
            // The completion queues are gone, and their reservations with them.
            timing.clear(|_| {});
        }
    }

    /// What every stop shares (controller reset, power loss, function reset): queues deleted,
    /// delayed completions and held Asynchronous Event Requests forgotten, features back to
    /// their defaults. The caller settled what
    /// was in flight first and reports the stop afterwards ([`ControllerCore::report_stopped`]).
    fn stop(&mut self) {
        self.drop_zeroing();
        // A shutdown still set runs again, from the start, on the stopped controller.
        self.shutdown_awaits_zeroing = false;
        self.drop_queues();
        // Aborted with the admin queue, which is gone: no completion (§5.2).
        self.async_event_requests.clear();
        self.features = Self::default_features(&self.config);
    }

    /// Reports a stop in CSTS. RDY = 0 tells the host that the controller no longer touches its
    /// memory (it may free or reuse it), so it is reported only once the kernel holds no
    /// transfer into or out of host memory; otherwise CSTS reads RDY = 1 with CFS (the
    /// controller failed to stop, never a clean stop) and the stop completes when the kernel
    /// gives them back ([`ControllerCore::finish_stopping`], polled). Returns how many are held.
    fn report_stopped(&mut self) -> usize {
        if self.host_memory_in_kernel() {
            let held = self.host_memory_in_kernel.len();
            tracing::error!(
                held,
                "the controller stopped, but the kernel still holds transfers into host memory that it would not cancel: \
                 CSTS reads RDY = 1 with CFS until it gives them back"
            );
            self.state = State::Stopping;
            self.registers.set_status(CSTS_READY | CSTS_FATAL);
            return held;
        }
        self.state = State::Disabled;
        self.registers.set_status(0);
        0
    }

    /// Completes a stop that waited for the kernel ([`State::Stopping`]) once it gave back every
    /// transfer into host memory: RDY = 0 and CFS = 0. Returns whether it did.
    fn finish_stopping(&mut self) -> bool {
        if self.host_memory_in_kernel() {
            return false;
        }
        tracing::warn!("the kernel gave back every transfer into host memory: the stop completes (CSTS.RDY = 0)");
        self.state = State::Disabled;
        self.registers.set_status(0);
        true
    }

    /// CC.EN 1 to 0 (§3.7.2): queues are deleted, features return to defaults, RDY and CFS clear
    /// (only once the kernel holds no transfer into host memory: see `report_stopped`). The
    /// write cache survives a controller reset (it is not a power loss). RDY reads 1 while the
    /// transfers in flight are cancelled; no doorbell is acted on meanwhile (this thread is
    /// here, and a scan stops at `RegisterFile::reset_requested`) and all are cleared after.
    fn reset_controller(&mut self) {
        // The kernel may still write the buffers of transfers in flight, and their commands'
        // queues are going away: cancel them at once and wait only for what the kernel keeps
        // (up to the cancel timeout, within CAP.TO), completing none. None of their commands
        // completed, so none has to land: a cancelled Write leaves its blocks as the cache
        // and the store held them.
        self.settle_in_flight(Settle::Discard);
        self.stop();
        self.registers.clear_doorbells();
        self.report_stopped();
    }

    /// CC.SHN (§3.6): on a shutdown notification SHST reads 01b (processing occurring) while what
    /// is in flight finishes, the cache is written back (and, with `sync_file_on_flush`, the file
    /// synced), then SHST reports complete; clearing SHN clears SHST.
    ///
    /// SHST = complete tells the host its data is durable (it may cut power next). A shutdown
    /// that could not make it so (the write-back or the sync failed, the store is fenced by a
    /// write the kernel kept, the controller is fatal) never reports it: SHST stays at 01b
    /// (processing occurring) and CSTS.CFS is set, so the host's wait for complete fails
    /// (nvme-driver: `ControllerFatal` as soon as it reads CFS). The blocks stay cached. A reset
    /// clears CFS; a host that leaves SHN set while it clears EN (nvme-driver's teardown does)
    /// has the shutdown run again right after the reset, so a write-back that still fails sets
    /// CFS again on the disabled controller.
    fn handle_shutdown(&mut self, cc: ControllerConfiguration) -> bool {
        let csts = self.registers.load32(registers::CSTS);
        let shutdown_status = csts & CSTS_SHUTDOWN_MASK;
        match cc.shutdown() {
            ShutdownNotification::None if shutdown_status != 0 => {
                self.shutdown_awaits_zeroing = false;
                self.registers.set_status(csts & !CSTS_SHUTDOWN_MASK);
                true
            }
            // Processed once per notification: a failed one (SHST 01b) is not retried at every
            // poll, only when the host clears SHN and sets it again. One that waited for a long
            // zeroing goes on once it ended.
            ShutdownNotification::Normal | ShutdownNotification::Abrupt if shutdown_status == 0 || self.shutdown_awaits_zeroing => {
                // The waits below can take up to the transfers' deadlines; the host polls SHST.
                self.registers.set_status(csts & !CSTS_SHUTDOWN_MASK | CSTS_SHUTDOWN_OCCURRING);
                // A long zeroing running (a slice per poll) ends first, as a command would have
                // when zeroing held the controller thread: the polls run its slices, releasing
                // the controller's lock between them, and this shutdown goes on at the first
                // poll after it ended (`react_to_configuration`). Its blocks are zeroed on the
                // store before SHST can read complete, so none reads stale after a restart. A
                // reset meanwhile (the host's wait for SHST gave up) drops it, as any stop does.
                if self.zeroing.is_some() && self.state == State::Ready {
                    self.shutdown_awaits_zeroing = true;
                    return true;
                }
                self.shutdown_awaits_zeroing = false;
                // The host's wait for SHST is bounded too (nvme-driver: RTD3E, at least CAP.TO):
                // when it gives up it clears CC.EN (SHN left set) and expects RDY = 0 within
                // CAP.TO, so this wait gives way to that reset as a Flush's does. Transfers
                // are then still in flight: writing the cache back now could put older cached
                // blocks over a Write in flight. The reset (next poll) cancels them and clears
                // SHST, and SHN, still set, runs this shutdown again on the disabled controller,
                // which writes the cache back with nothing in flight. A power loss, a function
                // reset or the device's drop asked for meanwhile (`stop_asked`) ends it too,
                // SHST still 01b: the first two reset every register (and a function reset
                // writes the cache back itself), and a dropped device writes nothing more.
                // A CC.EN = 0 write ends it only where a reset will follow (Ready, Fatal): on a
                // disabled controller none does, and a notification runs again only from SHST
                // 0, so giving way to it left SHST at 01b until the host cleared SHN. The wait
                // (`settle_unless_stopped`) still looks at any CC.EN = 0 (it is the Flush's
                // too), which matters only with transfers in flight, and a disabled controller
                // has none (its reset or stop settled them).
                #[cfg(test)]
                if let Some(hook) = self.before_shutdown_wait_for_tests.take() {
                    hook(&self.registers);
                }
                self.settle_unless_stopped();
                let reset_follows = matches!(self.state, State::Ready | State::Fatal) && self.registers.reset_requested();
                if self.zeroing.is_some() || !self.in_flight.is_empty() || reset_follows || self.unlocked.give_way() {
                    return true;
                }
                // A fence whose writes the kernel gave back since it was last looked at (only an
                // enable and a batch look) must not fail the shutdown: look now, after the wait,
                // which may have given them back too.
                self.refresh_store_fence();
                // The host may cut power once SHST says complete: with sync_file_on_flush the
                // written-back blocks reach the file's media first, as a Flush's would.
                let written = self.write_back(None).and_then(|()| if self.config.sync_file_on_flush { self.sync_store() } else { Ok(()) });
                let failure = match written {
                    Err(status) => Some(format!("the cache write-back failed ({status})")),
                    Ok(()) if self.store.is_fenced() => Some("a write the kernel kept may still land".to_string()),
                    Ok(()) if matches!(self.state, State::Fatal | State::Stopping) => Some("the controller is fatal".to_string()),
                    Ok(()) => None,
                };
                let csts = self.registers.load32(registers::CSTS) & !CSTS_SHUTDOWN_MASK;
                match failure {
                    None => self.registers.set_status(csts | CSTS_SHUTDOWN_COMPLETE),
                    Some(reason) => {
                        tracing::error!(reason, "shutdown failed: SHST is not reported complete, and CSTS.CFS is set");
                        if self.state == State::Ready {
                            // A disabled controller stays disabled (its CFS clears at the next
                            // enable); a running one stops processing, as any fatal one does.
                            // No long zeroing is held here (this shutdown waited for it above):
                            // a fatal controller would never run it, nor drop it but at a reset.
                            debug_assert!(self.zeroing.is_none(), "a fatal shutdown left a long zeroing held");
                            self.state = State::Fatal;
                        }
                        self.registers.set_status(csts | CSTS_SHUTDOWN_OCCURRING | CSTS_FATAL);
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Power is cut: unflushed cache contents are lost (all of them, or, in `mode`
    /// [`PowerLossMode::PartialWriteBack`], all but a pseudorandom subset written back first),
    /// in-flight commands get no completion, every register returns to its reset value. The
    /// backing store is kept.
    ///
    /// A real device loses the power to DMA with it; here the kernel may keep a transfer into
    /// host memory past the cut (one it would not cancel). Then CSTS does not read as a
    /// freshly powered controller: RDY = 1 with CFS, until the kernel gives it back (see
    /// `report_stopped`), so a host bringing the controller up again times out waiting for
    /// RDY = 0 instead of reusing memory the kernel may still write. Runs on the caller's thread
    /// (`EmuDevice::power_loss`) and returns when the cut is done.
    pub(crate) fn power_loss(&mut self, mode: PowerLossMode) {
        // Transfers in flight are cancelled where the kernel still can (those never land) and
        // waited for otherwise (those land, as a write already on its way to the media would);
        // none of their commands completes.
        self.settle_in_flight(Settle::PowerLoss);
        // After the settle: a Write that landed there dropped the older cached copies of its
        // blocks, which must not be written back over it now.
        if let PowerLossMode::PartialWriteBack { seed } = mode {
            self.write_back_some(seed);
        }
        self.cache.discard_all();
        self.stop();
        self.registers.power_on_reset();
        self.report_stopped();
        self.counters.totals.power_losses += 1;
        self.unsafe_shutdowns += 1;
        self.power_cycles += 1;
    }

    /// The device is being dropped and its controller thread ends here: the commands in flight
    /// never complete (nothing serves their queues again), so the transfers the kernel still
    /// holds are cancelled now, as a reset does (bounded by the 5 s cancel timeout; a ring left
    /// with transfers the kernel kept is abandoned and leaks their buffers), instead of the
    /// ring's drop waiting up to its own 5 s for transfers that may never end (a hung file).
    pub(crate) fn cancel_in_flight_for_drop(&mut self) {
        self.settle_in_flight(Settle::Discard);
    }

    /// Function-level reset: like a controller reset, plus registers to reset values. The cache
    /// is written back first (an FLR is not a power loss). Runs on the caller's thread (a
    /// host-side call, not a register write) and returns when the reset is done, after waiting
    /// for the transfers in flight as a controller reset does. An error when the write-back failed
    /// (the blocks stay cached) or when the kernel still holds transfers into host memory (the
    /// controller then reads RDY = 1 with CFS until it gives them back).
    pub(crate) fn function_reset(&mut self) -> Result<(), EmuError> {
        self.settle_in_flight(Settle::Discard);
        // As a shutdown's write-back: a fence whose writes the kernel gave back (only an enable
        // and a batch look otherwise) must not fail the reset on a store usable again.
        self.refresh_store_fence();
        let written = self.write_back(None);
        self.stop();
        self.registers.power_on_reset();
        match self.report_stopped() {
            0 => written.map_err(|status| EmuError::WriteBack { status }),
            transfers => Err(EmuError::HostMemoryInKernel { transfers }),
        }
    }
}
