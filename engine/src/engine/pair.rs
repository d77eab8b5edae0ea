//! A prefill/decode pair: two engines, each with its own device, joined by a [`KvLink`].
//!
//! A request enters the prefill engine, which computes its prompt and its first token (it runs
//! every request with one output token) and then holds it as an *export*: its pages and prefix
//! locks stay with it. The pair reserves the request's page table on the decode engine and hands
//! the link one transfer of every layer's KV and index-K pages. The request joins the decode
//! engine's running set only after the receive event of every layer completed; the prefill side
//! releases its pages (into its prefix cache, as a finished request's) only after the send
//! completed. A transfer whose events report a failure gives its decode pages back and is sent
//! again, up to [`TRANSFER_TRIES_MAX`] times; then the request ends with `Output::TransferFailed`.
//! A link may tell the decode side that a send is over by a message of its own
//! ([`KvLink::notified`]): the request is admitted only once it came, and a transfer whose every
//! layer arrived but whose message did not come within [`NOTIFICATION_DEADLINE_NS`] counts as
//! failed too (sent again; after the last try, `Output::TransferTimedOut`).
//! An aborted request is never published to decode: in prefill it is aborted there; in transfer
//! it waits for its copies to complete, then both sides' pages are released.
//!
//! When a side's device context is recreated (its device memory lost), the pair ends every
//! transfer in flight once its copies are over and gives its decode pages back; the request is
//! sent again, or, when the prefill side lost its pages, recomputed there first (every export
//! not yet admitted by decode goes back to the prefill queue, keeping its first token; the
//! exports of admitted requests are dropped). The decode side recomputes its
//! running requests' KV itself. The engines drop their device tiers when the pair tells them,
//! after it ended its transfers (`PdPair::after_recreations`).
//!
//! The pair speaks in the prefill engine's request ids: the decode engine admits each request
//! under the same id, and the outputs of both engines come out as one stream (the prefill
//! engine's internal `Finished` of an export is not passed on).

use super::{Engine, EngineError, EngineOptions, StepReport, Transferred};
use crate::config::Config;
use crate::device::{call_recovering, Clock, Device, EventId, EventState};
use crate::layout::{pages_for_tokens, BufferKind, LayerId, PageId};
use crate::mutants::Mutants;
use crate::pd::{
    handshake, HandshakeError, KvLink, LayerSend, LinkError, PdLayout, Role,
    NOTIFICATION_DEADLINE_NS,
};
use crate::probe::{self, Probe};
use crate::scheduler::{Output, Rejection, RequestSpec};
use std::collections::BTreeMap;

/// Sends of one request before it ends with `Output::TransferFailed`.
pub const TRANSFER_TRIES_MAX: u32 = 3;

/// Context recreations one look of [`PdPair`] handles in a row (each may fail a copy it waits
/// for, whose recovery may recreate a context again) before the pair stops.
pub const RECREATIONS_IN_A_ROW_MAX: u32 = 4;

/// Why a pair could not be built or could not go on.
#[derive(Debug, thiserror::Error)]
pub enum PdError {
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error("{role} engine: {source}")]
    Engine { role: Role, source: EngineError },
    #[error("KV link: {0}")]
    Link(#[from] LinkError),
    #[error("`overlap`: a prefill/decode pair's engines do not run one step ahead (not built)")]
    Overlap,
    /// Dropping what a recreated context lost recreated a context again, this many times in a
    /// row: the devices do not recover.
    #[error("the pair's device contexts were recreated {0} times in a row")]
    Recreations(u32),
}

impl PdError {
    fn prefill(source: EngineError) -> PdError {
        PdError::Engine {
            role: Role::Prefill,
            source,
        }
    }
    fn decode(source: EngineError) -> PdError {
        PdError::Engine {
            role: Role::Decode,
            source,
        }
    }
}

/// A transfer in flight.
#[derive(Debug)]
struct Sending {
    /// What the decode engine admits, its page table reserved there (the first pages receive
    /// the KV).
    request: Transferred,
    /// Per layer, in layer order, the decode side's receive event.
    received: Vec<EventId>,
    sent: EventId,
    /// The link refused a copy: the transfer failed.
    refused: bool,
    /// The decode engine's clock when the send was enqueued (its notification's deadline
    /// counts from here).
    sent_at_ns: u64,
    /// The prefill engine released its pages.
    released: bool,
}

/// A send whose request the decode engine admitted, until its `sent` event completed.
#[derive(Debug)]
struct Draining {
    id: u64,
    received: Vec<EventId>,
    sent: EventId,
    /// Mutant 15 released the prefill side's pages at issue.
    released: bool,
}

#[derive(Debug)]
enum Stage {
    /// In the prefill engine (queued or running).
    Prefill,
    /// Prefilled, held by the prefill engine, waiting for the decode side to have room.
    Exported,
    Sending(Sending),
    /// In the decode engine.
    Decoding,
}

#[derive(Debug)]
struct PdRequest {
    max_new: u32,
    stage: Stage,
    aborted: bool,
    tries: u32,
}

/// Counters of the pair's transfers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PdStats {
    pub transfers_started: u64,
    pub transfers_done: u64,
    pub transfers_failed: u64,
    /// Of those failed, the transfers whose every layer arrived but whose notification did
    /// not come in time.
    pub transfers_timed_out: u64,
    pub requests_failed: u64,
    /// Pages sent, counted per layer (a page of every layer counts `layers` times).
    pub layer_pages_sent: u64,
    /// Transfers in flight when a side's context was recreated: ended, not counted as failed
    /// (the request is sent again, or recomputed first when the prefill side lost it).
    pub transfers_lost: u64,
    /// Exports the prefill side recomputed after its context was recreated.
    pub exports_requeued: u64,
}

pub struct PdPair<D: Device, C: Clock, L: KvLink<D>> {
    /// Private: a request submitted to either engine directly would bypass the pair (the
    /// decode engine refuses submissions; the prefill engine's exports are the pair's).
    prefill: Engine<D, C>,
    decode: Engine<D, C>,
    link: L,
    mutants: Mutants,
    requests: BTreeMap<u64, PdRequest>,
    /// Sends of admitted requests, oldest first, until their `sent` completed.
    draining: Vec<Draining>,
    outputs: Vec<Output>,
    /// Events of finished transfers, for reuse: the decode side's and the prefill side's.
    free_received: Vec<EventId>,
    free_sent: Vec<EventId>,
    /// A transfer's event answered `Failed` since the last recovery: a stream of either side
    /// is in error, and nothing may be enqueued on it before the devices are recovered (at the
    /// end of `poll_transfers`).
    failure_seen: bool,
    /// Each side's `context_generation` when the pair last dropped what its transfers held
    /// there (prefill, decode).
    generations: [u64; 2],
    pub stats: PdStats,
}

impl<D: Device, C: Clock, L: KvLink<D>> PdPair<D, C, L> {
    /// Two engines and their link, after the layout handshake (refused: nothing is built).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        prefill_cfg: Config,
        decode_cfg: Config,
        prefill_dev: D,
        decode_dev: D,
        prefill_clock: C,
        decode_clock: C,
        link: L,
        opts: EngineOptions,
    ) -> Result<Self, PdError> {
        if opts.overlap {
            return Err(PdError::Overlap);
        }
        handshake(
            &PdLayout::of(&prefill_cfg, Role::Prefill),
            &PdLayout::of(&decode_cfg, Role::Decode),
        )?;
        let mut prefill =
            Engine::new(prefill_cfg, prefill_dev, prefill_clock, opts).map_err(PdError::prefill)?;
        let mut decode =
            Engine::new(decode_cfg, decode_dev, decode_clock, opts).map_err(PdError::decode)?;
        prefill.set_role(Role::Prefill);
        decode.set_role(Role::Decode);
        let generations = [prefill.context_generation, decode.context_generation];
        Ok(PdPair {
            prefill,
            decode,
            link,
            mutants: opts.mutants,
            requests: BTreeMap::new(),
            draining: Vec::new(),
            outputs: Vec::new(),
            free_received: Vec::new(),
            free_sent: Vec::new(),
            failure_seen: false,
            generations,
            stats: PdStats::default(),
        })
    }

    /// The prefill engine (the pair's intake, and each request until its KV is sent).
    pub fn prefill(&self) -> &Engine<D, C> {
        &self.prefill
    }
    /// The decode engine (each request after its KV arrived).
    pub fn decode(&self) -> &Engine<D, C> {
        &self.decode
    }
    /// Evicts up to `pages` device pages of the prefill engine's prefix cache now (the
    /// operator's request to hand memory back); how many were freed at once.
    pub fn evict_prefill(&mut self, pages: usize) -> Result<usize, PdError> {
        self.prefill.evict_device(pages).map_err(PdError::prefill)
    }
    /// Changes both engines' injected allocation faults (the simulator's).
    pub fn inject(&mut self, faults: super::EngineFaults) {
        self.prefill.inject(faults);
        self.decode.inject(faults);
    }

    /// Intake: the prefill engine's admission control, and the decode engine's limits on what
    /// the request will grow to.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<u64, Rejection> {
        let d = self.decode.config();
        let total = spec.prompt.len() as u64 + spec.max_new_tokens as u64;
        let reason = if spec.max_new_tokens == 0
            || spec.max_new_tokens > d.scheduler.output_tokens_max
        {
            Some(format!(
                "max_new_tokens = {} outside 1..={} (the decode engine's scheduler.output_tokens_max)",
                spec.max_new_tokens, d.scheduler.output_tokens_max
            ))
        } else if total > d.model.context_tokens_max as u64 {
            Some(format!(
                "prompt {} + max_new_tokens {} exceeds the decode engine's model.context_tokens_max = {}",
                spec.prompt.len(),
                spec.max_new_tokens,
                d.model.context_tokens_max
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(Rejection::Invalid { reason });
        }
        let max_new = spec.max_new_tokens;
        let id = self.prefill.submit(RequestSpec {
            prompt: spec.prompt,
            max_new_tokens: 1,
        })?;
        let prev = self.requests.insert(
            id,
            PdRequest {
                max_new,
                stage: Stage::Prefill,
                aborted: false,
                tries: 0,
            },
        );
        assert!(prev.is_none(), "request id {id} handed out twice");
        Ok(id)
    }

    /// One iteration: transfers started and polled, a prefill step, a decode step. A request
    /// prefilled in this step is sent in the next, after its first token went out with this
    /// step's outputs (the decode engine computes from that token).
    pub fn step(&mut self) -> Result<StepReport, PdError> {
        self.after_recreations()?;
        self.start_transfers()?;
        let polled = self.poll_transfers(false)?;
        // A recovery while polling may have recreated a context: handled before either engine
        // steps.
        self.after_recreations()?;
        let p = self.prefill.step().map_err(PdError::prefill)?;
        self.take_prefill_outputs()?;
        let d = self.decode.step().map_err(PdError::decode)?;
        self.take_decode_outputs();
        if p.rows == 0 && d.rows == 0 && !polled {
            // Nothing computed and no transfer finished: wait for the oldest transfer, so that
            // the next step progresses.
            self.poll_transfers(true)?;
        }
        let mut host = p.host;
        host.add(&d.host);
        Ok(StepReport {
            rows: p.rows + d.rows,
            admitted: p.admitted,
            idle: self.is_idle(),
            // Both engines' host time (one thread runs both); each device's timing is its
            // engine's own (`Engine::metrics`).
            host,
            device: None,
        })
    }

    /// Nothing in either engine or in transfer.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
            && self.draining.is_empty()
            && self.prefill.is_idle()
            && self.decode.is_idle()
    }

    pub fn drain_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    /// Requests the pair holds, in transfer or waiting for one.
    pub fn in_transfer(&self) -> usize {
        self.requests
            .values()
            .filter(|r| matches!(r.stage, Stage::Exported | Stage::Sending(_)))
            .count()
    }

    /// Where each request is, for reports: `id: stage`, in id order.
    pub fn stages(&self) -> String {
        let mut out = Vec::new();
        for (id, r) in &self.requests {
            let stage = match &r.stage {
                Stage::Prefill => "prefill".to_string(),
                Stage::Exported => format!("exported (tries {})", r.tries),
                Stage::Sending(s) => format!(
                    "sending {} pages (aborted {})",
                    s.request.pages.len(),
                    r.aborted
                ),
                Stage::Decoding => "decoding".to_string(),
            };
            out.push(format!("{id}: {stage}"));
        }
        out.join(", ")
    }

    /// Aborts a request wherever it is. One in transfer ends once its copies completed.
    pub fn abort(&mut self, id: u64) -> Result<bool, PdError> {
        let Some(r) = self.requests.get_mut(&id) else {
            return Ok(false);
        };
        if r.aborted {
            return Ok(true);
        }
        match r.stage {
            Stage::Prefill => {
                if self.mutants.pd_publishes_aborted() && self.prefill.export_unfinished(id) {
                    // Mutant 14: published to decode as if its prompt were computed.
                    r.stage = Stage::Exported;
                    return Ok(true);
                }
                let found = self.prefill.abort(id);
                self.requests.remove(&id);
                self.take_prefill_outputs()?;
                Ok(found)
            }
            Stage::Exported => {
                self.requests.remove(&id);
                self.prefill.release_export(id).map_err(PdError::prefill)?;
                self.take_prefill_outputs()?;
                probe::hit(Probe::PdAbortInTransfer);
                self.outputs.push(Output::Aborted { request: id });
                Ok(true)
            }
            Stage::Sending(_) => {
                r.aborted = true;
                probe::hit(Probe::PdAbortInTransfer);
                Ok(true)
            }
            Stage::Decoding => {
                self.requests.remove(&id);
                let found = self.decode.abort(id);
                self.take_decode_outputs();
                Ok(found)
            }
        }
    }

    fn take_prefill_outputs(&mut self) -> Result<(), PdError> {
        self.pass_prefill_outputs();
        // Requests of one output token end on the prefill side: nothing to send. Their
        // completion there is the request's.
        let done: Vec<u64> = self
            .prefill
            .exports()
            .filter(|r| {
                self.requests
                    .get(&r.id)
                    .is_some_and(|p| matches!(p.stage, Stage::Prefill) && p.max_new <= r.generated)
            })
            .map(|r| r.id)
            .collect();
        for id in done {
            self.requests.remove(&id);
            self.prefill.release_export(id).map_err(PdError::prefill)?;
            self.outputs.extend(self.prefill.drain_outputs());
        }
        // Prefilled requests become exports.
        for r in self.prefill.exports() {
            if let Some(p) = self.requests.get_mut(&r.id) {
                if matches!(p.stage, Stage::Prefill) {
                    p.stage = Stage::Exported;
                }
            }
        }
        Ok(())
    }

    /// The prefill engine's outputs, less the internal completions of exports.
    fn pass_prefill_outputs(&mut self) {
        for o in self.prefill.drain_outputs() {
            match o {
                // An export's completion on the prefill side: internal.
                Output::Finished { .. } => {}
                Output::Aborted { request } => {
                    self.requests.remove(&request);
                    self.outputs.push(o);
                }
                o => self.outputs.push(o),
            }
        }
    }

    /// The decode engine's outputs, less its requeues: a request the decode side recomputes
    /// after its context was recreated stays with it, and does not go back to the pair's intake
    /// (its engine's `requests_requeued` counts it).
    fn take_decode_outputs(&mut self) {
        for o in self.decode.drain_outputs() {
            match o {
                Output::Requeued { .. } => continue,
                Output::Finished { request, .. } | Output::Aborted { request } => {
                    self.requests.remove(&request);
                }
                _ => {}
            }
            self.outputs.push(o);
        }
    }

    fn event(pool: &mut Vec<EventId>, dev: &mut D) -> Result<EventId, EngineError> {
        match pool.pop() {
            Some(e) => Ok(e),
            // A device in error refuses the creation until it is recovered.
            None => Ok(call_recovering(dev, |d| d.new_event())?),
        }
    }

    /// Starts the transfer of every export the decode side has room for, oldest first.
    fn start_transfers(&mut self) -> Result<(), PdError> {
        let ids: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.stage, Stage::Exported))
            .map(|(&id, _)| id)
            .collect();
        let running_max = self.decode.config().scheduler.running_requests_max as usize;
        let held = self.decode_held();
        // Each transfer started below adds one to those in flight.
        for (started, id) in ids.into_iter().enumerate() {
            if held + started >= running_max {
                probe::hit(Probe::PdDecodeFull);
                break;
            }
            let max_new = self.requests[&id].max_new;
            let ex = self
                .prefill
                .export(id)
                .expect("an exported request is held");
            let total = pages_for_tokens((ex.prompt_len + max_new as usize) as u64) as usize;
            let sent_pages = pages_for_tokens(ex.computed as u64) as usize;
            let src: Vec<PageId> = ex.pages[..sent_pages].to_vec();
            let (tokens, prompt_len, computed, generated) =
                (ex.tokens.clone(), ex.prompt_len, ex.computed, ex.generated);
            let Some(pages) = self.decode.reserve_import(total).map_err(PdError::decode)? else {
                probe::hit(Probe::PdDecodeFull);
                break;
            };
            let filled = self.mutants.pd_received_pages(&pages, src.len());
            let pairs: Vec<(PageId, PageId)> =
                src.iter().copied().zip(filled.iter().copied()).collect();
            let layers = self.prefill.layout().layers();
            let mut received = Vec::with_capacity(layers as usize);
            let mut sends = Vec::with_capacity(layers as usize);
            for l in 0..layers {
                let ev = Self::event(&mut self.free_received, &mut self.decode.dev)
                    .map_err(PdError::decode)?;
                received.push(ev);
                let dl = LayerId(self.mutants.pd_decode_layer(l as usize, layers as usize) as u32);
                let side = |k| {
                    (
                        self.prefill.pools().device_side(k, LayerId(l)),
                        self.decode.pools().device_side(k, dl),
                    )
                };
                sends.push(LayerSend {
                    layer: LayerId(l),
                    kv: side(BufferKind::Kv),
                    index_k: side(BufferKind::IndexK),
                    received: ev,
                });
            }
            let sent = Self::event(&mut self.free_sent, &mut self.prefill.dev)
                .map_err(PdError::prefill)?;
            let after = self.prefill.step_event();
            let (prefill_dev, decode_dev) = (&mut self.prefill.dev, &mut self.decode.dev);
            let mut refused = false;
            match self
                .link
                .send(prefill_dev, decode_dev, after, &pairs, &sends, sent)
            {
                Ok(()) => {}
                Err(LinkError::Refused(_)) => {
                    probe::hit(Probe::PdTransferRefused);
                    refused = true;
                }
                // A pair whose sides' pages differ, or a device that cannot record an event,
                // cannot go on.
                Err(e) => return Err(e.into()),
            }
            self.stats.transfers_started += 1;
            self.stats.layer_pages_sent += (pairs.len() * layers as usize) as u64;
            let mut released = false;
            if self.mutants.pd_frees_before_send() {
                self.prefill.release_export(id).map_err(PdError::prefill)?;
                self.take_prefill_outputs()?;
                released = true;
            }
            self.requests.get_mut(&id).expect("exported").stage = Stage::Sending(Sending {
                request: Transferred {
                    id,
                    tokens,
                    prompt_len,
                    computed,
                    generated,
                    max_new,
                    pages,
                },
                received,
                sent,
                refused,
                sent_at_ns: self.decode.clock.now_ns(),
                released,
            });
        }
        Ok(())
    }

    /// The requests the decode side runs or will: its running set, its queue (the requests it
    /// recomputes after its context was recreated) and the transfers in flight.
    fn decode_held(&self) -> usize {
        self.decode.running_len() + self.decode.queue_len() + self.ids_sending().len()
    }

    /// Moves transfers on (with `wait`: waits for the oldest send first). A request joins the
    /// decode engine once every layer's receive event completed; its send is over, and the
    /// prefill side's pages released, once `sent` completed — which a link may report later
    /// (`draining`). Whether anything moved.
    fn poll_transfers(&mut self, wait: bool) -> Result<bool, PdError> {
        let mut any = false;
        let ids = self.ids_sending();
        if wait {
            self.wait_oldest();
        }
        for id in ids {
            any |= self.poll_transfer(id)?;
        }
        let mut i = 0;
        // Not across a recreation: `after_recreations` drops what a lost prefill side held.
        while i < self.draining.len() && !self.recreation_pending() {
            let sent = self.prefill_query(self.draining[i].sent);
            if sent == EventState::Pending {
                probe::hit(Probe::PdSendDraining);
                i += 1;
                continue;
            }
            any = true;
            let d = self.draining.remove(i);
            self.free_received.extend_from_slice(&d.received);
            self.free_sent.push(d.sent);
            if self.failure_seen {
                // This send's `sent` failed (a backup ahead of it on the prefill side's write
                // stream failed, or a mutant admitted before every copy succeeded), or an event
                // looked at earlier in this poll did: the devices' errors are cleared before
                // the release below enqueues (a write-through backup, say).
                self.recover_both()?;
            }
            if !d.released {
                let held = self
                    .prefill
                    .release_export(d.id)
                    .map_err(PdError::prefill)?;
                assert!(held, "request {}: its export was released twice", d.id);
                self.take_prefill_outputs()?;
            }
        }
        if self.failure_seen {
            // A receive or a send failed while others of its transfer were still running: the
            // stream stays in error until recovered, and the next transfer or step enqueues.
            self.recover_both()?;
        }
        Ok(any)
    }

    /// Waits for the oldest send: its `sent` and its receives (which may finish later), then,
    /// if every layer of an admissible send arrived, for its notification until its deadline
    /// (mutant 41 has none, and waits no longer than a look).
    fn wait_oldest(&mut self) {
        let oldest = self
            .requests
            .values()
            .find_map(|r| match &r.stage {
                Stage::Sending(s) => {
                    let admissible = !r.aborted && !s.refused;
                    Some((
                        s.sent,
                        s.received.clone(),
                        admissible.then_some(s.sent_at_ns),
                    ))
                }
                _ => None,
            })
            .or_else(|| self.draining.first().map(|d| (d.sent, Vec::new(), None)));
        let Some((sent, received, sent_at)) = oldest else {
            return;
        };
        self.prefill_sync(sent);
        let mut arrived = true;
        for ev in received {
            arrived &= self.decode_sync(ev) == EventState::Done;
        }
        let deadline = self
            .mutants
            .pd_notification_deadline_ns(NOTIFICATION_DEADLINE_NS);
        if let (true, Some(at), Some(d)) = (arrived, sent_at, deadline) {
            self.link
                .wait_notified(&mut self.decode.dev, sent, at.saturating_add(d));
        }
    }

    /// Moves the transfer of `id` on: admits it once every awaited layer arrived and the link
    /// told the decode side; fails it (to be sent again, or ended) once every copy of it is
    /// over without that — a copy failed or was refused, its notification did not come by its
    /// deadline, or it was aborted. Whether it moved.
    fn poll_transfer(&mut self, id: u64) -> Result<bool, PdError> {
        if self.recreation_pending() {
            // A side's memory was lost since the pair last looked: what arrived may be garbage.
            // The transfer is ended by `after_recreations`.
            return Ok(false);
        }
        let r = &self.requests[&id];
        let Stage::Sending(s) = &r.stage else {
            unreachable!("polling a request not in transfer");
        };
        // Decode admits once the receive of every layer completed (mutant 17: the first).
        let awaited = self.mutants.pd_layers_awaited(s.received.len());
        let admissible = !r.aborted && !s.refused;
        let (all, sent, refused, sent_at) = (s.received.clone(), s.sent, s.refused, s.sent_at_ns);
        let received = &all[..awaited];
        if admissible && self.all_done(received) && self.notified(sent) {
            self.admit(id);
            return Ok(true);
        }
        // Not admitted: the transfer is over only when the send and every receive are (a send
        // may complete on the prefill side before its receive on the decode side, as NCCL's
        // does, and the decode pages must not go back while a receive writes them). `sent` is
        // the prefill side's event. (Mutant 39 gives up at the first failure or refusal.)
        let gave_up = self.mutants.pd_gives_up_at_first_failure()
            && (refused
                || all
                    .iter()
                    .any(|&ev| self.decode_query(ev) == EventState::Failed));
        if !gave_up
            && (self.prefill_query(sent) == EventState::Pending
                || all
                    .iter()
                    .any(|&ev| self.decode_query(ev) == EventState::Pending))
        {
            return Ok(false);
        }
        let mut timed_out = false;
        // Every layer may have arrived since the look above.
        if admissible && self.all_done(received) {
            if self.notified(sent) {
                self.admit(id);
                return Ok(true);
            }
            // Every copy arrived, and the decode side was not told: it waits for the
            // notification until its deadline (mutant 41: forever).
            probe::hit(Probe::PdNotificationAwaited);
            let now = self.decode.clock.now_ns();
            match self
                .mutants
                .pd_notification_deadline_ns(NOTIFICATION_DEADLINE_NS)
            {
                Some(d) if now >= sent_at.saturating_add(d) => timed_out = true,
                _ => return Ok(false),
            }
        }
        self.fail_transfer(id, timed_out)?;
        Ok(true)
    }

    /// Each side's context generation now (prefill, decode).
    fn generations_now(&self) -> [u64; 2] {
        [
            self.prefill.dev.context_generation(),
            self.decode.dev.context_generation(),
        ]
    }

    /// Whether a side's context was recreated since the pair last dropped what it held there.
    fn recreation_pending(&self) -> bool {
        self.generations != self.generations_now()
    }

    /// The requests in transfer, by id.
    fn ids_sending(&self) -> Vec<u64> {
        self.requests
            .iter()
            .filter(|(_, r)| matches!(r.stage, Stage::Sending(_)))
            .map(|(&id, _)| id)
            .collect()
    }

    /// When a side's context was recreated since the pair last looked (by any recovery), its
    /// device memory is gone. The pair drops what its transfers held there, then has each
    /// engine drop its device tier (`Engine::drop_device_tier`; an engine of a pair never does
    /// on its own):
    /// - every transfer in flight ends once its copies did (a recreated context's queued work
    ///   never runs; a copy that ran before may still read or write), and its decode pages go
    ///   back: the request is sent again from the prefill side's pages, or, when the prefill
    ///   side lost them, recomputed there first;
    /// - when the prefill side lost its memory, the exports of requests decode admitted already
    ///   are dropped once their sends are over (`Engine::drop_export`), and every other export
    ///   goes back to the prefill queue, behind the running requests, to recompute its KV;
    /// - the decode side's running requests recompute their KV there, as a single engine's do.
    ///
    /// Waiting for the copies may answer `Failed`, and recovering from that may recreate a
    /// context again: the pair looks again, up to `RECREATIONS_IN_A_ROW_MAX` times.
    fn after_recreations(&mut self) -> Result<(), PdError> {
        for _ in 0..RECREATIONS_IN_A_ROW_MAX {
            if !self.recreation_pending() {
                return Ok(());
            }
            self.generations = self.generations_now();
            probe::hit(Probe::PdContextRecreated);
            // Nothing below recovers a device before `recover_both`: the prefill engine's
            // pending recreation is the one the pass began with.
            let prefill_lost = self.prefill.recreation_pending();
            for id in self.ids_sending() {
                if self.mutants.pd_admits_across_recreation() && self.arrived(id) {
                    self.admit(id); // mutant 44
                    continue;
                }
                self.end_lost_transfer(id);
            }
            if prefill_lost {
                self.drop_admitted_exports();
            }
            self.prefill.drop_device_tier().map_err(PdError::prefill)?;
            self.decode.drop_device_tier().map_err(PdError::decode)?;
            // The prefill side requeued its exports (to recompute their KV).
            for (&id, r) in self.requests.iter_mut() {
                if matches!(r.stage, Stage::Exported) && self.prefill.export(id).is_none() {
                    r.stage = Stage::Prefill;
                    self.stats.exports_requeued += 1;
                }
            }
            if self.failure_seen {
                self.recover_both()?;
            }
        }
        if !self.recreation_pending() {
            return Ok(());
        }
        Err(PdError::Recreations(RECREATIONS_IN_A_ROW_MAX))
    }

    /// Mutant 44's test: transfer `id` is admissible and every layer's receive answered `Done`.
    fn arrived(&mut self, id: u64) -> bool {
        let r = &self.requests[&id];
        let Stage::Sending(s) = &r.stage else {
            unreachable!("in transfer");
        };
        let (admissible, received) = (!r.aborted && !s.refused, s.received.clone());
        admissible && self.all_done(&received)
    }

    /// Ends the transfer of `id` after a side's context was recreated, once every copy of it is
    /// over: its decode pages go back; the request is sent again (recomputed first when the
    /// prefill side lost its pages, `after_recreations`), or ends: aborted (its export dropped, not cached: caching it could enqueue a backup
    /// before the devices recovered), or with its prefill pages gone (mutant 15). It makes no
    /// call that recovers a device.
    fn end_lost_transfer(&mut self, id: u64) {
        let r = self.requests.get_mut(&id).expect("in transfer");
        let Stage::Sending(s) = std::mem::replace(&mut r.stage, Stage::Exported) else {
            unreachable!("in transfer");
        };
        let (aborted, tries) = (r.aborted, r.tries);
        self.prefill_sync(s.sent);
        for &ev in &s.received {
            self.decode_sync(ev);
        }
        self.free_received.extend_from_slice(&s.received);
        self.free_sent.push(s.sent);
        self.decode.cancel_import(&s.request.pages);
        self.stats.transfers_lost += 1;
        let end = if aborted {
            Output::Aborted { request: id }
        } else if s.released {
            self.stats.requests_failed += 1;
            Output::TransferFailed { request: id, tries }
        } else {
            return;
        };
        self.requests.remove(&id);
        self.outputs.push(end);
        if !s.released {
            let held = self.prefill.drop_export(id);
            assert!(held, "request {id}: its export was released twice");
        }
    }

    /// The prefill side lost its memory: the exports of the requests decode admitted are dropped
    /// once their sends are over (the decode side has their KV).
    fn drop_admitted_exports(&mut self) {
        for d in std::mem::take(&mut self.draining) {
            self.prefill_sync(d.sent);
            self.free_received.extend_from_slice(&d.received);
            self.free_sent.push(d.sent);
            if !d.released {
                let held = self.prefill.drop_export(d.id);
                assert!(held, "request {}: its export was released twice", d.id);
            }
        }
    }

    /// A transfer's event answered `Failed`, or a transfer was refused: both sides' errors are
    /// cleared. The receives ran on the decode side; the send's `sent` may be recorded on the
    /// prefill side (behind its backups, as an NCCL send completes on the sender's stream), so
    /// its failure may be a prefill stream's, and the prefill side must not enqueue on that
    /// stream (a backup, say) before it is recovered.
    fn recover_both(&mut self) -> Result<(), PdError> {
        self.failure_seen = false;
        self.decode
            .dev
            .recover()
            .map_err(|e| PdError::decode(e.into()))?;
        self.prefill
            .dev
            .recover()
            .map_err(|e| PdError::prefill(e.into()))
    }

    /// The host's look at a transfer's event on either side: a `Failed` answer is remembered
    /// (`failure_seen`) for the recovery.
    fn seen(&mut self, state: EventState) -> EventState {
        self.failure_seen |= state == EventState::Failed;
        state
    }

    fn prefill_query(&mut self, ev: EventId) -> EventState {
        let state = self.prefill.dev.query(ev);
        self.seen(state)
    }

    fn decode_query(&mut self, ev: EventId) -> EventState {
        let state = self.decode.dev.query(ev);
        self.seen(state)
    }

    fn prefill_sync(&mut self, ev: EventId) -> EventState {
        let state = self.prefill.dev.synchronize(ev);
        self.seen(state)
    }

    fn decode_sync(&mut self, ev: EventId) -> EventState {
        let state = self.decode.dev.synchronize(ev);
        self.seen(state)
    }

    /// Whether the link told the decode side that the send of `sent` is over.
    fn notified(&mut self, sent: EventId) -> bool {
        self.link.notified(&mut self.decode.dev, sent)
    }

    /// Whether every one of `events` completed without a failure.
    fn all_done(&mut self, events: &[EventId]) -> bool {
        events
            .iter()
            .all(|&ev| self.decode_query(ev) == EventState::Done)
    }

    /// Every awaited layer of `id` arrived: the decode engine takes the request, and the send
    /// drains (its `sent` releases the prefill side's pages).
    fn admit(&mut self, id: u64) {
        let r = self.requests.get_mut(&id).expect("in transfer");
        let Stage::Sending(s) = std::mem::replace(&mut r.stage, Stage::Decoding) else {
            unreachable!("in transfer");
        };
        probe::hit(Probe::PdAdmitted);
        self.stats.transfers_done += 1;
        self.decode.admit_transferred(s.request);
        self.draining.push(Draining {
            id,
            received: s.received,
            sent: s.sent,
            released: s.released,
        });
    }

    /// The send of `id` is over without the request admitted: a copy failed or was refused, its
    /// notification did not come in time (`timed_out`), or the request was aborted. Its decode
    /// pages go back; it is sent again, or ends.
    fn fail_transfer(&mut self, id: u64, timed_out: bool) -> Result<(), PdError> {
        let r = self.requests.get_mut(&id).expect("in transfer");
        let Stage::Sending(s) = std::mem::replace(&mut r.stage, Stage::Exported) else {
            unreachable!("in transfer");
        };
        let failed = s.refused
            || timed_out
            || !self.all_done(&s.received)
            || self.prefill_query(s.sent) != EventState::Done;
        let r = self.requests.get_mut(&id).expect("in transfer");
        assert!(
            failed || r.aborted,
            "request {id}: a complete send neither admitted, failed nor aborted"
        );
        self.free_received.extend_from_slice(&s.received);
        self.free_sent.push(s.sent);
        self.decode.cancel_import(&s.request.pages);
        if failed {
            // A copy failed (its destination holds unspecified bytes) or was refused; the
            // devices are recovered below.
            self.stats.transfers_failed += 1;
            self.stats.transfers_timed_out += timed_out as u64;
            probe::hit(Probe::PdTransferFailed);
            probe::hit_if(Probe::PdNotificationTimedOut, timed_out);
            r.tries += 1;
        }
        let tries = r.tries;
        let end = if r.aborted {
            Some(Output::Aborted { request: id })
        } else if tries >= TRANSFER_TRIES_MAX || s.released {
            self.stats.requests_failed += 1;
            Some(if timed_out {
                Output::TransferTimedOut { request: id, tries }
            } else {
                Output::TransferFailed { request: id, tries }
            })
        } else {
            None // sent again from the prefill side's pages, which it still holds
        };
        if failed || self.failure_seen {
            // Before the release below enqueues (a write-through backup, say): this transfer's
            // failure, or one an earlier event of this poll answered.
            self.recover_both()?;
        }
        if let Some(o) = end {
            self.requests.remove(&id);
            self.outputs.push(o);
            if !s.released {
                let held = self.prefill.release_export(id).map_err(PdError::prefill)?;
                assert!(held, "request {id}: its export was released twice");
                self.take_prefill_outputs()?;
            }
        }
        Ok(())
    }

    /// Both engines' invariants, and the pair's: every request is where its stage says, the
    /// decode side holds exactly the pages of the sends not yet admitted, and every draining
    /// send's export is still held (unless mutant 15 released it).
    pub fn check_invariants(&self) {
        self.prefill.check_invariants();
        self.decode.check_invariants();
        let mut sending_pages = 0;
        for (&id, r) in &self.requests {
            let in_decode = self.decode.request(id).is_some();
            match &r.stage {
                Stage::Prefill => assert!(
                    self.prefill.request(id).is_some() && !in_decode,
                    "request {id} in prefill, which does not hold it"
                ),
                Stage::Exported => assert!(
                    self.prefill.export(id).is_some() && !in_decode,
                    "request {id} exported, which the prefill engine does not hold"
                ),
                Stage::Sending(s) => {
                    assert!(
                        (s.released || self.prefill.export(id).is_some()) && !in_decode,
                        "request {id} in transfer, released by the prefill engine or decoding"
                    );
                    sending_pages += s.request.pages.len();
                }
                Stage::Decoding => assert!(
                    in_decode,
                    "request {id} decoding, which the decode engine does not hold"
                ),
            }
        }
        assert_eq!(
            self.decode.pages_held_for_transfers(),
            sending_pages,
            "decode pages held for transfers = the pages of the sends in flight"
        );
        for d in &self.draining {
            assert!(
                d.released || self.prefill.export(d.id).is_some(),
                "request {}: its send drains, but the prefill engine released its pages",
                d.id
            );
        }
    }

    /// At quiescence: both engines quiescent, nothing in transfer.
    pub fn check_quiescent(&self) -> Result<(), String> {
        if !self.requests.is_empty() {
            return Err(format!(
                "{} requests still in the pair",
                self.requests.len()
            ));
        }
        self.prefill
            .check_quiescent()
            .map_err(|e| format!("prefill engine: {e}"))?;
        self.decode
            .check_quiescent()
            .map_err(|e| format!("decode engine: {e}"))
    }
}
