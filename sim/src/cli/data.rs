//! The data built into the `tierkv` binary, so that its commands work from any directory: the
//! excerpt of the Mooncake conversation trace (`data/mooncake/`, Apache-2.0; its README gives
//! the source), the default trace of `sim --profile trace` and `replay`.

use tierkv_engine::trace::{parse_jsonl, TraceError, TraceRecord};

/// The first 1,000 requests of the Mooncake FAST'25 conversation trace.
pub const MOONCAKE_EXCERPT: &str =
    include_str!("../../../data/mooncake/conversation_trace_excerpt.jsonl");

/// How reports name the built-in trace.
pub const MOONCAKE_EXCERPT_NAME: &str =
    "the built-in Mooncake conversation trace excerpt (1,000 requests)";

/// The built-in trace, parsed.
pub fn mooncake_excerpt() -> Result<Vec<TraceRecord>, TraceError> {
    parse_jsonl(MOONCAKE_EXCERPT)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_built_in_trace_parses_in_order() {
        let recs = super::mooncake_excerpt().expect("the excerpt parses");
        assert_eq!(recs.len(), 1000);
        assert!(recs
            .windows(2)
            .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
    }
}
