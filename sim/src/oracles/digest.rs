//! The digest oracle: every digest the engine emits is held to the specification's digest
//! (`tierkv_kernels::spec::digest`, written from the digest's definition) of the selection the
//! GPU read for that query and layer, over the specification's KV rows of the tokens at the
//! selected positions. Whether that selection is the right one is the content oracle's
//! judgement (`content.rs`): its size and positions for every query, and, for a sampled share of
//! the queries, a top-k of the specification's own f64 logits within the f32 logits' bound.
//!
//! This module shares no function with the kernels' CPU references or the executor (a test in
//! `sim/tests/it` reads its source to keep it so): the row format, the digest and the
//! selection's judgement come from the specification; the rows' input values are the synthetic
//! model's (`Synth`).

use super::content::ContentOracle;
use tierkv_kernels::spec;

pub struct DigestOracle {
    pub layers: u32,
    pub layer_base: u32,
    pub digests_checked: u64,
}

impl DigestOracle {
    pub fn new(cfg: &tierkv_engine::Config) -> Self {
        DigestOracle {
            layers: cfg.model.layers,
            layer_base: cfg.model.layer_base,
            digests_checked: 0,
        }
    }

    /// The specification's digest of `request`'s query at `position` in global `layer`, over the
    /// selection the GPU read; why there is none (no `sparse_read` of that query was seen, or it
    /// selected a position whose token is unknown).
    pub fn expected(
        &mut self,
        c: &mut ContentOracle,
        request: u64,
        position: u32,
        layer: u32,
    ) -> Result<u64, String> {
        let pairs: Vec<(u32, u32)> = {
            let selected = c
                .selections
                .get(&(request, position, layer))
                .ok_or("no sparse_read of that query ran")?;
            let tokens = c.tokens.get(&request).ok_or("the request is unknown")?;
            let weights = c.weights_of(request);
            selected
                .iter()
                .map(|&n| {
                    tokens
                        .get(n as usize)
                        .map(|&t| (ContentOracle::model_token(t, weights), n))
                        .ok_or(format!(
                            "its selection names position {n}, past the known tokens"
                        ))
                })
                .collect::<Result<_, String>>()?
        };
        let hashes: Vec<u64> = pairs
            .into_iter()
            .map(|(t, n)| c.kv_row_hash(t, n, layer))
            .collect();
        Ok(spec::digest_of(hashes.into_iter().map(Some)))
    }

    /// Checks one emitted `Digests` output; the message of the first digest that differs.
    pub fn check(
        &mut self,
        c: &mut ContentOracle,
        request: u64,
        position: u32,
        digests: &[u64],
    ) -> Option<String> {
        if digests.len() != self.layers as usize {
            return Some(format!(
                "request {request} position {position}: {} digests for {} layers",
                digests.len(),
                self.layers
            ));
        }
        for (l, &got) in digests.iter().enumerate() {
            let layer = self.layer_base + l as u32;
            self.digests_checked += 1;
            let want = match self.expected(c, request, position, layer) {
                Ok(w) => w,
                Err(why) => {
                    return Some(format!(
                        "request {request} position {position} layer {layer}: digest {got:#018x} \
                         emitted, and none is expected: {why}"
                    ))
                }
            };
            if got != want {
                return Some(format!(
                    "request {request} position {position} layer {layer}: digest {got:#018x}; the \
                     specification's digest of the selection read is {want:#018x}"
                ));
            }
        }
        None
    }
}
