//! The conservation oracle: at the end of a run every device page, host page, pin and lock is
//! accounted for — the pools hold exactly what the prefix cache holds, nothing is locked or pinned,
//! no load or backup is in flight. Two checks, made after the device has drained:
//! - the engine's own accounting (`Engine::check_quiescent`; during the run its invariant
//!   assertions, `Engine::check_invariants`, check the same equations after every step);
//! - the simulator's shadow of it ([`audit`]), which trusts no bookkeeping of the engine: every
//!   page the prefix cache says it holds, on either tier, must hold — in the simulator's memory,
//!   in every layer, KV and index-K — the rows the synthetic model gives the tokens the cache
//!   files it under, and no page may be held twice. A page freed while the cache still points at
//!   it and then reused, a backup or load published over a failed or torn copy, a node filed
//!   under the wrong prefix: each leaves bytes that differ. A prefix's rows are those of the
//!   weights its first key carries (`cache::model_page_keys`: the version above the first
//!   token), as the engine files it.

use crate::oracles::content::ContentOracle;
use crate::oracles::content::WEIGHTS_SHIFT;
use crate::report::{Finding, OracleKind};
use std::collections::BTreeMap;
use tierkv_engine::cache::{NodeId, ROOT};
use tierkv_engine::cpu_device::Memory;
use tierkv_engine::device::{BufferId, BufferRole};
use tierkv_engine::layout::{BufferKind, LayerId, PageId, PAGE_TOKENS};
use tierkv_kernels::spec::format::Placement;

pub fn check<D, C, T>(engine: &tierkv_engine::Engine<D, C, T>, time_ns: u64) -> Option<Finding>
where
    D: tierkv_engine::device::Device,
    C: tierkv_engine::device::Clock,
    T: tierkv_engine::transfer::Transfer,
{
    engine.check_quiescent().err().map(|message| Finding {
        oracle: OracleKind::Conservation,
        time_ns,
        message,
    })
}

/// The buffer of `role` of the `nth` engine on `mem` (a prefill/decode pair's two engines
/// allocate the same roles, prefill's first).
fn buffer(mem: &Memory, role: BufferRole, nth: usize) -> BufferId {
    (0..mem.descs.len() as u32)
        .map(BufferId)
        .filter(|&b| mem.desc(b).role == role)
        .nth(nth)
        .unwrap_or_else(|| panic!("no {role} buffer of engine {nth}"))
}

/// The simulator's shadow check of what the prefix cache holds (see the module comment).
pub fn audit<D, C, T>(
    engine: &tierkv_engine::Engine<D, C, T>,
    nth: usize,
    mem: &Memory,
    content: &mut ContentOracle,
    time_ns: u64,
) -> Option<Finding>
where
    D: tierkv_engine::device::Device,
    C: tierkv_engine::device::Clock,
    T: tierkv_engine::transfer::Transfer,
{
    let found = |message: String| {
        Some(Finding {
            oracle: OracleKind::Conservation,
            time_ns,
            message,
        })
    };
    let cache = engine.cache();
    let cfg = engine.config();
    let layer_base = cfg.model.layer_base;
    let layers = cfg.model.layers;
    // The first position of each node: its depth in the tree, in pages.
    let mut depth: BTreeMap<NodeId, u32> = BTreeMap::new();
    let mut depth_of = |id: NodeId| -> u32 {
        let (mut path, mut at) = (Vec::new(), id);
        let mut d = loop {
            if at == ROOT {
                break 0;
            }
            if let Some(&d) = depth.get(&at) {
                break d;
            }
            path.push(at);
            at = cache.node(at).parent;
        };
        for &n in path.iter().rev() {
            d += 1;
            depth.insert(n, d);
        }
        depth[&id]
    };
    // Per tier, layer and kind: the buffer and where its pages are, by the specification's
    // placement (a device pool holds one layer; the host mirror every layer, in the configured
    // order), not by the engine's views.
    let host = |layer| Placement::Host {
        order: cfg.cache.host_layout,
        layers,
        pages: cfg.host_pages(),
        layer,
    };
    let sides: Vec<[(BufferKind, BufferId, Placement); 2]> = (0..2)
        .flat_map(|tier| {
            (0..layers).map(move |l| {
                BufferKind::ALL.map(|kind| {
                    if tier == 0 {
                        let role = BufferRole::Pool {
                            kind,
                            layer: LayerId(l),
                        };
                        (kind, buffer(mem, role, nth), Placement::Device)
                    } else {
                        let role = BufferRole::Mirror { kind };
                        (kind, buffer(mem, role, nth), host(l))
                    }
                })
            })
        })
        .collect();
    let mut holders: [BTreeMap<PageId, NodeId>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let nodes: Vec<NodeId> = cache.live_nodes().collect();
    for id in nodes {
        let n = cache.node(id);
        let first = (depth_of(id) - 1) * PAGE_TOKENS;
        // The weights the prefix was computed under: carried by its first page's key.
        let mut top = id;
        while cache.node(top).parent != ROOT {
            top = cache.node(top).parent;
        }
        let weights = cache.node(top).key[0] >> WEIGHTS_SHIFT;
        let tagged = if top == id { 1 } else { 0 };
        if let Some(t) = n.key[tagged..].iter().find(|&&t| t >> WEIGHTS_SHIFT != 0) {
            return found(format!(
                "node {id}'s key holds {t:#x}, above every token, where only a prefix's first \
                 key word carries the weights' version"
            ));
        }
        let untag = (1u32 << WEIGHTS_SHIFT) - 1;
        let tokens: Vec<u32> = n
            .key
            .iter()
            .map(|&t| ContentOracle::model_token(t & untag, weights))
            .collect();
        for (tier, page) in [(0usize, n.device), (1, n.host)] {
            let Some(page) = page else {
                continue;
            };
            if let Some(other) = holders[tier].insert(page, id) {
                return found(format!(
                    "{} page {page} is held by two nodes of the prefix cache ({other} and {id})",
                    ["device", "host"][tier]
                ));
            }
            for l in 0..layers {
                for (kind, buf, placement) in sides[tier * layers as usize + l as usize] {
                    if let Some(e) = content.audit_page(
                        mem,
                        kind,
                        buf,
                        placement,
                        page.0,
                        &tokens,
                        first,
                        layer_base + l,
                    ) {
                        return found(format!(
                            "{} page {page}, which the prefix cache holds for positions {first}..{} (node {id}): {e}",
                            ["device", "host"][tier],
                            first + PAGE_TOKENS
                        ));
                    }
                }
            }
        }
    }
    None
}
