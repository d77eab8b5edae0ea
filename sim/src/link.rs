//! The simulated KV link of a prefill/decode pair: the peer link of one address space (page
//! copies on the decode side's load stream of the shared simulated GPU, so latency, bandwidth,
//! slow, failed, refused and torn copies are the GPU's fault model) with the layers of each
//! transfer sent in a seeded order, as independent sends may complete in any order, and the
//! send's completion reported on the prefill side's write stream, behind its backups — as an
//! NCCL send completes on the sender's stream — so it may come well after every layer arrived.
//!
//! When the scenario asks for it (`notify_loss_rate`, `notify_late_ns_max`), the link also tells
//! the decode side that a send is over by a message of its own, as NIXL's push mode does: the
//! message comes a drawn delay after the send's last layer arrived, or never (lost).
//! Its draws come from a generator of their own, so that the layer orders stay as they were.

use crate::driver::SimDevice;
use crate::rng::Rng;
use std::collections::BTreeMap;
use tierkv_engine::device::{call_recovering, Device, EventId, StreamKind};
use tierkv_engine::layout::PageId;
use tierkv_engine::pd::{KvLink, LayerSend, LinkError, PeerLink};

pub struct SimLink {
    rng: Rng,
    /// Recorded on the decode side after a send's last layer, awaited by the prefill side's
    /// write stream before it records the send's `sent` (one event, re-recorded per send).
    arrived: Option<EventId>,
    /// Notifications, when modelled.
    notify: Option<Notifications>,
    /// Per send in flight (keyed by its `sent` event, which is reused after the transfer is
    /// over: each send overwrites its entry), its message.
    notes: BTreeMap<EventId, Note>,
}

/// How the link's notifications behave (`Scenario::notify_loss_rate`, `notify_late_ns_max`).
struct Notifications {
    /// Their own generator: the layer orders stay as they were without them.
    rng: Rng,
    loss_rate: f64,
    late_ns_max: u64,
}

/// The message of one send: sent once its last layer arrived on the decode side (each layer's
/// `received`), `delay_ns` later; `None`: lost.
struct Note {
    received: Vec<EventId>,
    delay_ns: Option<u64>,
}

impl SimLink {
    pub fn new(seed: u64) -> SimLink {
        SimLink::with_notifications(seed, 0.0, 0)
    }

    /// A link whose notifications are lost with probability `loss_rate` and come at most
    /// `late_ns_max` after the send's last layer arrived; with 0 and 0 it sends none
    /// (`SimLink::new`).
    pub fn with_notifications(seed: u64, loss_rate: f64, late_ns_max: u64) -> SimLink {
        let notify = (loss_rate > 0.0 || late_ns_max > 0).then(|| Notifications {
            rng: Rng::new(seed ^ 0x4E07_1F1E),
            loss_rate,
            late_ns_max,
        });
        SimLink {
            rng: Rng::new(seed ^ 0x004C_1A4B),
            arrived: None,
            notify,
            notes: BTreeMap::new(),
        }
    }

    /// When the decode side hears of the send of `sent`: when its last layer arrived, plus the
    /// message's delay; `None` while a layer has not arrived (or failed: the transfer fails
    /// anyway), or when the message is lost.
    fn heard_at(&self, decode: &SimDevice, sent: EventId) -> Option<u64> {
        let note = self.notes.get(&sent)?;
        let delay = note.delay_ns?;
        let g = sim_side(decode).gpu.borrow();
        let mut last = 0;
        for &ev in &note.received {
            last = last.max(g.record_done_at(ev)?);
        }
        Some(last.saturating_add(delay))
    }
}

fn sim_side(d: &SimDevice) -> &crate::gpu::SimSide {
    match d {
        SimDevice::Direct(s) => s,
        SimDevice::Runtime(_) => unreachable!("a pair's sides run on the simulated GPU directly"),
    }
}

impl KvLink<SimDevice> for SimLink {
    fn send(
        &mut self,
        prefill: &mut SimDevice,
        decode: &mut SimDevice,
        after: EventId,
        pairs: &[(PageId, PageId)],
        layers: &[LayerSend],
        sent: EventId,
    ) -> Result<(), LinkError> {
        let mut order = layers.to_vec();
        for i in (1..order.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        crate::probes::hit_if(
            crate::probes::SimProbe::PdLayersReordered,
            order.iter().zip(layers).any(|(a, b)| a.layer != b.layer),
        );
        let arrived = match self.arrived {
            Some(e) => e,
            // A side in error refuses these calls until it is recovered, as the engine's own
            // link calls do (`call_recovering`).
            None => *self
                .arrived
                .insert(call_recovering(decode, |d| d.new_event())?),
        };
        if let Some(n) = &mut self.notify {
            let lost = n.rng.chance(n.loss_rate);
            let delay = n.rng.range(0, n.late_ns_max);
            crate::probes::hit_if(crate::probes::SimProbe::PdNotificationLost, lost);
            let note = Note {
                received: layers.iter().map(|l| l.received).collect(),
                delay_ns: (!lost).then_some(delay),
            };
            self.notes.insert(sent, note);
        }
        let r = PeerLink.send(prefill, decode, after, pairs, &order, arrived);
        if matches!(r, Ok(()) | Err(LinkError::Refused(_))) {
            call_recovering(prefill, |d| d.wait(StreamKind::Write, arrived))?;
            call_recovering(prefill, |d| d.record(StreamKind::Write, sent))?;
        }
        r
    }

    fn notified(&mut self, decode: &mut SimDevice, sent: EventId) -> bool {
        if self.notify.is_none() {
            return true;
        }
        let now = sim_side(decode).gpu.borrow().now();
        self.heard_at(decode, sent).is_some_and(|t| t <= now)
    }

    /// The decode host blocks: its clock moves to the message, or to `until_ns` if it comes
    /// later or never.
    fn wait_notified(&mut self, decode: &mut SimDevice, sent: EventId, until_ns: u64) -> bool {
        if self.notify.is_none() {
            return true;
        }
        let heard = self.heard_at(decode, sent);
        let wake = heard.map_or(until_ns, |t| t.min(until_ns));
        sim_side(decode).gpu.borrow_mut().advance_host_to(wake);
        self.notified(decode, sent)
    }
}
