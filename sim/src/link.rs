//! The simulated KV link of a prefill/decode pair: the peer link of one address space (page
//! copies on the decode side's load stream of the shared simulated GPU, so latency, bandwidth,
//! slow, failed, refused and torn copies are the GPU's fault model) with the layers of each
//! transfer sent in a seeded order, as independent sends may complete in any order, and the
//! send's completion reported on the prefill side's write stream, behind its backups — as an
//! NCCL send completes on the sender's stream — so it may come well after every layer arrived.

use crate::driver::SimDevice;
use crate::rng::Rng;
use tierkv_engine::device::{call_recovering, Device, EventId, StreamKind};
use tierkv_engine::layout::PageId;
use tierkv_engine::pd::{KvLink, LayerSend, LinkError, PeerLink};

pub struct SimLink {
    rng: Rng,
    /// Recorded on the decode side after a send's last layer, awaited by the prefill side's
    /// write stream before it records the send's `sent` (one event, re-recorded per send).
    arrived: Option<EventId>,
}

impl SimLink {
    pub fn new(seed: u64) -> SimLink {
        SimLink {
            rng: Rng::new(seed ^ 0x004C_1A4B),
            arrived: None,
        }
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
        let r = PeerLink.send(prefill, decode, after, pairs, &order, arrived);
        if matches!(r, Ok(()) | Err(LinkError::Refused(_))) {
            call_recovering(prefill, |d| d.wait(StreamKind::Write, arrived))?;
            call_recovering(prefill, |d| d.record(StreamKind::Write, sent))?;
        }
        r
    }
}
