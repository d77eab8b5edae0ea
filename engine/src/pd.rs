//! Prefill/decode disaggregation: the layout handshake and the KV link.
//!
//! A prefill engine and a decode engine that exchange a request's KV must agree, before the first
//! transfer, on everything that decides what the bytes of a page mean and where they go: the
//! layers (their number and global ids), each pool's page format (dtype, bytes per token, bytes
//! per page, tokens per page), the host mirror's order (a transfer may read pages the prefill
//! side holds only in its mirror), the fp8 scale format of the index keys (when either side
//! stores them in fp8; KV tiles always carry fp32 scales), and the RoPE frequencies the stored
//! index keys were rotated with: decode's queries are rotated with its own, and a key rotated with
//! other frequencies scores against them as garbage. Where `model.rope_yarn` follows DeepSeek's
//! reference, YaRN applies only when `model.context_tokens_max` exceeds
//! `model.rope_original_seq_len`, so two engines of one model whose contexts fall on either side
//! of that length disagree (under the servers' rule, the default, they agree). Each
//! side announces a [`PdLayout`]; the [`handshake`] compares them and refuses any difference with
//! a [`HandshakeError`] that names every differing field and both sides' values. tierkv converts
//! no layout in transfer (a bf16 index-K on one side and an fp8 one on the other is refused,
//! never requantised on the fly).
//!
//! The transfer itself goes through a [`KvLink`]: it moves one request's pages of every layer
//! from the prefill device's pools to the decode device's, and records an event on the decode
//! side per layer (`LayerSend::received`) and one after the whole send (`sent`). The pair
//! (`engine::pair::PdPair`) admits the request on the decode side only after every layer's
//! receive event, and releases the prefill side's pages only after `sent`.
//!
//! Links: [`PeerLink`] for two devices in one address space — the in-order CPU device shared by
//! both engines ([`SharedDevice`]: unit tests, and `replay --pd` on one device), the
//! simulator's two GPUs of one executor (whose `SimLink` sends the layers in a seeded order) —
//! as page copies on the decode side's load stream. Between two GPUs the production link is
//! `runtime::nccl::NcclLink` (feature `nccl`: NCCL send/recv on the prefill engine's write
//! stream and the decode engine's load stream), which `replay --pd --pd-gpus 2` uses. Not
//! built: a pair across machines.

use crate::config::{Config, ScaleFmt};
use crate::device::{
    call_recovering, BufferDesc, BufferId, Device, DeviceError, EventId, EventState, Op, StreamKind,
};
use crate::layout::{
    coalesce_runs, Bytes, HostLayout, IndexKDtype, LayerId, LayoutFingerprint, PageFormat, PageId,
};
use crate::pools::PoolSide;
use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;
use tierkv_kernels::rope::Rope;

/// Which side of the pair an engine is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

/// What one engine announces about the KV it sends or receives.
#[derive(Clone, Debug, PartialEq)]
pub struct PdLayout {
    pub role: Role,
    /// The configuration's name, for messages.
    pub name: String,
    pub layers: u32,
    pub layer_base: u32,
    pub kv: LayoutFingerprint,
    pub index_k: LayoutFingerprint,
    pub host_layout: HostLayout,
    pub scale_fmt: ScaleFmt,
    /// The 32 RoPE inverse frequencies of the index keys, as bits (equal only when identical).
    pub rope_inv_freq: [u64; 32],
    /// How the frequencies were made, for messages.
    pub rope: String,
}

impl PdLayout {
    /// The layout `cfg` gives an engine of `role`.
    pub fn of(cfg: &Config, role: Role) -> PdLayout {
        let params = cfg.rope();
        let rope = Rope::new(&params);
        let m = &cfg.model;
        PdLayout {
            role,
            name: cfg.name.clone(),
            layers: m.layers,
            layer_base: m.layer_base,
            kv: PageFormat::Kv(m.kv_dtype).fingerprint(),
            index_k: PageFormat::IndexK(m.index_k_dtype).fingerprint(),
            host_layout: cfg.cache.host_layout,
            scale_fmt: m.scale_fmt,
            rope_inv_freq: rope.inv_freq().map(f64::to_bits),
            rope: if params.yarn() {
                format!(
                    "theta {}, YaRN factor {} over {} tokens (beta {}/{}; rope_yarn {}) for a \
                     {}-token context",
                    params.theta,
                    params.factor,
                    params.original_seq_len,
                    params.beta_fast,
                    params.beta_slow,
                    m.rope_yarn.name(),
                    params.max_seq_len
                )
            } else {
                format!(
                    "theta {}, no YaRN (rope_yarn {}, factor {}, a {}-token context, {} original)",
                    params.theta,
                    m.rope_yarn.name(),
                    params.factor,
                    params.max_seq_len,
                    params.original_seq_len
                )
            },
        }
    }
}

/// One field the two sides disagree on, with each side's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub field: &'static str,
    pub prefill: String,
    pub decode: String,
}

/// Why a prefill/decode pair was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error(
        "a prefill/decode pair needs one prefill and one decode engine: got {first} and {second}"
    )]
    Roles { first: Role, second: Role },
    #[error(
        "the prefill engine ({prefill}) and the decode engine ({decode}) disagree on the KV they \
         would exchange, and tierkv converts no layout in transfer: {}",
        list(mismatches)
    )]
    Layout {
        prefill: String,
        decode: String,
        mismatches: Vec<Mismatch>,
    },
}

fn list(m: &[Mismatch]) -> String {
    m.iter()
        .map(|m| format!("{} (prefill: {}; decode: {})", m.field, m.prefill, m.decode))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The handshake: `Ok` when the two sides' KV is byte-for-byte interchangeable, else every
/// difference. Either side may be given first.
pub fn handshake(a: &PdLayout, b: &PdLayout) -> Result<(), HandshakeError> {
    let (p, d) = match (a.role, b.role) {
        (Role::Prefill, Role::Decode) => (a, b),
        (Role::Decode, Role::Prefill) => (b, a),
        (first, second) => return Err(HandshakeError::Roles { first, second }),
    };
    let mut mismatches = Vec::new();
    let mut differ = |field: &'static str, pv: String, dv: String| {
        if pv != dv {
            mismatches.push(Mismatch {
                field,
                prefill: pv,
                decode: dv,
            });
        }
    };
    differ("model.layers", p.layers.to_string(), d.layers.to_string());
    differ(
        "model.layer_base",
        p.layer_base.to_string(),
        d.layer_base.to_string(),
    );
    differ("model.kv_dtype", p.kv.to_string(), d.kv.to_string());
    differ(
        "model.index_k_dtype",
        p.index_k.to_string(),
        d.index_k.to_string(),
    );
    differ(
        "cache.host_layout",
        p.host_layout.name().to_string(),
        d.host_layout.name().to_string(),
    );
    // The scale format decides index-K bytes only where they are fp8.
    let fp8 = |l: &PdLayout| l.index_k.format == PageFormat::IndexK(IndexKDtype::Fp8);
    if fp8(p) || fp8(d) {
        differ(
            "model.scale_fmt",
            p.scale_fmt.name().to_string(),
            d.scale_fmt.name().to_string(),
        );
    }
    if p.rope_inv_freq != d.rope_inv_freq {
        mismatches.push(Mismatch {
            field: "RoPE frequencies of the index keys",
            prefill: p.rope.clone(),
            decode: d.rope.clone(),
        });
    }
    if mismatches.is_empty() {
        Ok(())
    } else {
        Err(HandshakeError::Layout {
            prefill: p.name.clone(),
            decode: d.name.clone(),
            mismatches,
        })
    }
}

/// One layer of a transfer: the prefill side's pools of the layer and the decode side's (KV and
/// index-K), and the event the decode side records once this layer's pages arrived.
#[derive(Clone, Copy, Debug)]
pub struct LayerSend {
    /// The prefill side's local layer (for reports).
    pub layer: LayerId,
    pub kv: (PoolSide, PoolSide),
    pub index_k: (PoolSide, PoolSide),
    pub received: EventId,
}

/// Why a link could not take a transfer.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LinkError {
    #[error(
        "KV link refused layer {layer}: prefill pages are {prefill}, decode pages are {decode}"
    )]
    Layout {
        layer: LayerId,
        prefill: LayoutFingerprint,
        decode: LayoutFingerprint,
    },
    /// A copy of the transfer was refused at enqueue: the transfer failed, and every one of its
    /// events was recorded all the same (wait for `sent` before reusing its pages).
    #[error("KV link: a copy was refused: {0}")]
    Refused(DeviceError),
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// The transport of a prefill/decode pair: moves one request's pages, every layer, from the
/// prefill device to the decode device.
pub trait KvLink<D: Device> {
    /// Enqueues the transfer of `pairs` (prefill page, decode page) of every layer in `layers`,
    /// ordered after the prefill side's `after` event: each layer's `received` (a decode-side
    /// event) is recorded on the decode side after that layer's copies, and `sent` (a
    /// prefill-side event, which the pair queries on the prefill device) once the whole send is
    /// over. Layers are independent: a link may send them in any order.
    /// `LinkError::Refused`: the transfer failed, its events recorded (the caller waits for
    /// `sent`, then sends again); `Layout`: nothing was enqueued; `Device`: an event could not
    /// be recorded, and the device is not to be trusted.
    fn send(
        &mut self,
        prefill: &mut D,
        decode: &mut D,
        after: EventId,
        pairs: &[(PageId, PageId)],
        layers: &[LayerSend],
        sent: EventId,
    ) -> Result<(), LinkError>;

    /// Whether the decode side has been told that the send whose `sent` event was handed to
    /// [`KvLink::send`] is over: the prefill side's message after its writes, as in NIXL's push
    /// mode, where the decode side learns from it, not from its own events, that the KV is
    /// there. Such a message can be lost or late; the pair admits the request only once it
    /// came, and gives the transfer up when it did not come by [`NOTIFICATION_DEADLINE_NS`]
    /// after the send. A link whose decode side sees the copies' own events, as both of
    /// tierkv's production links do ([`PeerLink`], NCCL's), has no message to lose: `true`.
    fn notified(&mut self, _decode: &mut D, _sent: EventId) -> bool {
        true
    }

    /// Blocks until [`KvLink::notified`] answers `true` or the decode side's clock reads
    /// `until_ns`, whichever comes first; whether it was notified. The default answers
    /// `notified` at once: right for a link whose `notified` is always `true`; a link that
    /// overrides `notified` must override this too, or the pair looks again step by step.
    fn wait_notified(&mut self, decode: &mut D, sent: EventId, _until_ns: u64) -> bool {
        self.notified(decode, sent)
    }
}

/// How long after a send was enqueued the decode side waits for its notification
/// ([`KvLink::notified`]), in nanoseconds of the decode engine's clock: a transfer whose every
/// layer arrived but whose notification did not come by then (lost, late, or its layers slow)
/// counts as failed (it is sent again, up to the pair's tries), as vLLM's and
/// SGLang's decode sides time out a transfer whose notification never came. 10 ms: far above
/// what a transfer of the simulated link takes to be reported, far below the minutes a
/// production stack waits (tierkv's own links never lose a notification; see `notified`).
pub const NOTIFICATION_DEADLINE_NS: u64 = 10_000_000;

/// Every layer's two sides hold pages of one format: the check each link makes before it sends
/// a byte (the handshake compared the configurations; this compares the pools themselves).
pub fn check_layers(layers: &[LayerSend]) -> Result<(), LinkError> {
    for l in layers {
        for (src, dst) in [l.kv, l.index_k] {
            let (p, d) = (src.view().fingerprint, dst.view().fingerprint);
            if p != d {
                return Err(LinkError::Layout {
                    layer: l.layer,
                    prefill: p,
                    decode: d,
                });
            }
        }
    }
    Ok(())
}

/// The link between two devices of one address space: page copies on the decode side's load
/// stream (after it waited for the prefill side's event), each layer's event recorded there, and
/// `sent` too. It needs the two devices to share one table of buffers and events: the decode
/// side waits on the prefill side's `after` and the prefill side queries `sent` — true of the
/// simulator's two sides and of `SharedDevice`, not of two separate CUDA devices (their link is
/// NCCL's: `runtime/nccl.rs`, feature `nccl`).
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerLink;

impl<D: Device> KvLink<D> for PeerLink {
    fn send(
        &mut self,
        _prefill: &mut D,
        decode: &mut D,
        after: EventId,
        pairs: &[(PageId, PageId)],
        layers: &[LayerSend],
        sent: EventId,
    ) -> Result<(), LinkError> {
        check_layers(layers)?;
        let s = StreamKind::Load;
        // A device in error refuses these calls until it is recovered (`call_recovering`).
        call_recovering(decode, |d| d.wait(s, after))?;
        let runs = coalesce_runs(pairs);
        // A copy the device refuses fails the transfer, but every event is still recorded, so
        // the caller can wait for the copies already enqueued before it reuses their pages.
        let mut refused = None;
        for l in layers {
            if !pairs.is_empty() && refused.is_none() {
                for (src, dst) in [l.kv, l.index_k] {
                    if let Err(e) = decode.enqueue(s, src.copy_to(dst, runs.clone())) {
                        // A refusal of the copy's arguments (a layout the device does not
                        // hold) is a bug, not a failed transfer to send again.
                        if !e.is_transient() {
                            return Err(LinkError::Device(e));
                        }
                        refused = Some(e);
                        break;
                    }
                }
            }
            call_recovering(decode, |d| d.record(s, l.received))?;
        }
        call_recovering(decode, |d| d.record(s, sent))?;
        match refused {
            Some(e) => Err(LinkError::Refused(e)),
            None => Ok(()),
        }
    }
}

/// One device shared by the two engines of a pair (both handles reach the same buffers, streams
/// and events): for unit tests on the in-order CPU device, and `tierkv replay --pd`, where both
/// engines share one CUDA GPU and its three streams (correct, as every order between the two
/// engines' work is an event's; but not the timing of two GPUs).
pub struct SharedDevice<D>(pub Rc<RefCell<D>>);

impl<D> Clone for SharedDevice<D> {
    fn clone(&self) -> Self {
        SharedDevice(self.0.clone())
    }
}

impl<D: Device> Device for SharedDevice<D> {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        self.0.borrow_mut().alloc(desc)
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.0.borrow().desc(buf)
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        self.0.borrow_mut().new_event()
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.0.borrow_mut().record(stream, ev)
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.0.borrow_mut().wait(stream, ev)
    }
    fn query(&mut self, ev: EventId) -> EventState {
        self.0.borrow_mut().query(ev)
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.0.borrow_mut().synchronize(ev)
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        self.0.borrow_mut().enqueue(stream, op)
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.0.borrow_mut().host_read(buf, offset, out)
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        self.0.borrow_mut().host_write(buf, offset, data)
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.0.borrow_mut().recover()
    }
    /// The one device's: a recreation by either engine's `recover` loses both engines' memory.
    fn context_generation(&self) -> u64 {
        self.0.borrow().context_generation()
    }
    /// The one device's timing, taken by whichever of the two engines asks first.
    fn take_timing(&mut self) -> Option<crate::device::DeviceTiming> {
        self.0.borrow_mut().take_timing()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::YarnRule;

    /// Refusals and reports name the pair's roles.
    #[test]
    fn roles_are_named() {
        assert_eq!(Role::Prefill.to_string(), "prefill");
        assert_eq!(Role::Decode.to_string(), "decode");
    }

    /// A shared device passes host writes to the device it shares (both engines of a pair see
    /// them).
    #[test]
    fn a_shared_device_passes_host_writes_through() {
        use crate::cpu_device::InOrderDevice;
        use crate::device::{BufferDesc, BufferRole, MemoryTier};
        use crate::layout::{Bytes, LayoutFingerprint};
        let inner = Rc::new(RefCell::new(InOrderDevice::new()));
        let mut a = SharedDevice(Rc::clone(&inner));
        let mut b = a.clone();
        let buf = a
            .alloc(BufferDesc {
                role: BufferRole::Scratch { name: "test" },
                tier: MemoryTier::PinnedHost,
                bytes: Bytes(8),
                fingerprint: LayoutFingerprint::unpaged(8),
            })
            .unwrap();
        a.host_write(buf, Bytes(2), &[5, 6]).unwrap();
        let mut out = [0u8; 2];
        b.host_read(buf, Bytes(2), &mut out).unwrap();
        assert_eq!(out, [5, 6]);
    }

    /// sim-small with fp8 index keys (whose scale format counts), and a copy edited by `edit`.
    fn pair(edit: impl FnOnce(&mut Config)) -> (PdLayout, PdLayout) {
        let mut p = Config::preset("sim-small").unwrap();
        p.model.index_k_dtype = IndexKDtype::Fp8;
        let mut d = p.clone();
        edit(&mut d);
        (
            PdLayout::of(&p, Role::Prefill),
            PdLayout::of(&d, Role::Decode),
        )
    }

    #[test]
    fn equal_layouts_agree_in_either_order() {
        let (p, d) = pair(|_| {});
        assert_eq!(handshake(&p, &d), Ok(()));
        assert_eq!(handshake(&d, &p), Ok(()));
    }

    #[test]
    fn a_bf16_prefill_index_k_and_an_fp8_decode_are_refused_naming_both() {
        let mut p = Config::preset("sim-small").unwrap();
        p.model.index_k_dtype = IndexKDtype::Bf16;
        let mut d = p.clone();
        d.model.index_k_dtype = IndexKDtype::Fp8;
        let e = handshake(
            &PdLayout::of(&p, Role::Prefill),
            &PdLayout::of(&d, Role::Decode),
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("model.index_k_dtype (prefill: index_k/bf16 (256 B/token, 16384 B/page); decode: index_k/fp8 (132 B/token, 8448 B/page))"),
            "{text}"
        );
        let HandshakeError::Layout { mismatches, .. } = e else {
            panic!("a layout error");
        };
        assert_eq!(mismatches.len(), 1, "{mismatches:?}");
    }

    #[test]
    fn every_differing_field_is_named() {
        let (p, d) = pair(|d| {
            d.model.layers += 1;
            d.cache.host_layout = match d.cache.host_layout {
                HostLayout::LayerFirst => HostLayout::PageFirst,
                HostLayout::PageFirst => HostLayout::LayerFirst,
            };
            d.model.scale_fmt = match d.model.scale_fmt {
                ScaleFmt::Fp32 => ScaleFmt::Ue8m0,
                ScaleFmt::Ue8m0 => ScaleFmt::Fp32,
            };
            d.model.rope_theta *= 2.0;
        });
        let Err(HandshakeError::Layout { mismatches, .. }) = handshake(&p, &d) else {
            panic!("refused");
        };
        let fields: Vec<_> = mismatches.iter().map(|m| m.field).collect();
        assert_eq!(
            fields,
            [
                "model.layers",
                "cache.host_layout",
                "model.scale_fmt",
                "RoPE frequencies of the index keys"
            ]
        );
    }

    #[test]
    fn the_scale_format_counts_only_where_index_keys_are_fp8() {
        let mut p = Config::preset("sim-small").unwrap();
        p.model.index_k_dtype = IndexKDtype::Bf16;
        let mut d = p.clone();
        d.model.scale_fmt = match p.model.scale_fmt {
            ScaleFmt::Fp32 => ScaleFmt::Ue8m0,
            ScaleFmt::Ue8m0 => ScaleFmt::Fp32,
        };
        let (pl, dl) = (
            PdLayout::of(&p, Role::Prefill),
            PdLayout::of(&d, Role::Decode),
        );
        assert_eq!(
            handshake(&pl, &dl),
            Ok(()),
            "bf16 index keys carry no scale"
        );
        p.model.index_k_dtype = IndexKDtype::Fp8;
        d.model.index_k_dtype = IndexKDtype::Fp8;
        let (pl, dl) = (
            PdLayout::of(&p, Role::Prefill),
            PdLayout::of(&d, Role::Decode),
        );
        assert!(
            handshake(&pl, &dl).is_err(),
            "fp8 index keys differ in their scales"
        );
    }

    #[test]
    fn two_engines_of_one_role_are_refused() {
        let c = Config::preset("sim-small").unwrap();
        let p = PdLayout::of(&c, Role::Prefill);
        assert_eq!(
            handshake(&p, &p),
            Err(HandshakeError::Roles {
                first: Role::Prefill,
                second: Role::Prefill
            })
        );
    }

    #[test]
    fn yarn_on_one_side_only_is_refused() {
        // One rule on each side: YaRN by the servers' rule, plain RoPE by the reference's at
        // sim-small's 2048 tokens.
        let (p, d) = pair(|d| d.model.rope_yarn = YarnRule::ContextAboveOriginal);
        let e = handshake(&p, &d).unwrap_err().to_string();
        assert!(
            e.contains("RoPE frequencies of the index keys (prefill: theta 10000, YaRN factor"),
            "{e}"
        );
        assert!(
            e.contains("decode: theta 10000, no YaRN (rope_yarn context_above_original"),
            "{e}"
        );
        // The reference's rule on both sides, contexts on either side of the original length.
        let reference = |c: &mut Config| c.model.rope_yarn = YarnRule::ContextAboveOriginal;
        let mut pc = Config::preset("sim-small").unwrap();
        reference(&mut pc);
        let mut dc = pc.clone();
        dc.model.context_tokens_max = 2 * dc.model.rope_original_seq_len;
        let e = handshake(
            &PdLayout::of(&pc, Role::Prefill),
            &PdLayout::of(&dc, Role::Decode),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("prefill: theta 10000, no YaRN"), "{e}");
        assert!(e.contains("decode: theta 10000, YaRN factor"), "{e}");
    }

    #[test]
    fn a_longer_context_keeps_the_frequencies_where_the_rule_allows() {
        // The servers' rule: YaRN on both sides whatever the context, so the frequencies agree.
        let (p, d) = pair(|d| d.model.context_tokens_max = 2 * d.model.rope_original_seq_len);
        assert_eq!(handshake(&p, &d), Ok(()));
        // The reference's: no YaRN on either side within the original length.
        let (p, d) = pair(|d| {
            d.model.rope_yarn = YarnRule::ContextAboveOriginal;
            d.model.context_tokens_max = d.model.rope_original_seq_len;
        });
        let mut pc = Config::preset("sim-small").unwrap();
        pc.model.index_k_dtype = IndexKDtype::Fp8;
        pc.model.rope_yarn = YarnRule::ContextAboveOriginal;
        assert_eq!(handshake(&PdLayout::of(&pc, Role::Prefill), &d), Ok(()));
        assert!(handshake(&p, &d).is_err(), "the default prefill has YaRN");
    }
}
