//! `tierkv check-config`: the derived layout of a configuration, or its validation error.

use super::error::CliError;
use std::path::PathBuf;
use tierkv_engine::config::Config;
use tierkv_engine::layout::BufferKind;

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{bytes} B ({v:.2} {})", UNITS[u])
    }
}

/// `check-config --pd-decode FILE`: the layout handshake of a prefill engine configured by
/// `file`/`preset` and a decode engine configured by `decode`.
pub fn run_pd(file: Option<&PathBuf>, preset: Option<&str>, decode: &PathBuf) -> i32 {
    use tierkv_engine::pd::{handshake, PdLayout, Role};
    let prefill_name = match (file, preset) {
        (Some(f), _) => f.display().to_string(),
        (None, Some(p)) => format!("preset {p}"),
        (None, None) => {
            return CliError::Arguments(format!(
                "--pd-decode {}: give the prefill engine's configuration too (a FILE or --preset)",
                decode.display()
            ))
            .report();
        }
    };
    let decode_name = decode.display().to_string();
    let p = super::load_config(file, preset);
    let d = super::load_config(Some(decode), None);
    let (p, d) = match (p, d) {
        (Ok(p), Ok(d)) => (p, d),
        (p, d) => {
            let said: Vec<String> = [("prefill", p.err()), ("decode", d.err())]
                .into_iter()
                .filter_map(|(side, e)| Some(format!("the {side} engine's configuration: {}", e?)))
                .collect();
            return CliError::Config(said.join("\n")).report();
        }
    };
    let (pl, dl) = (
        PdLayout::of(&p, Role::Prefill),
        PdLayout::of(&d, Role::Decode),
    );
    match handshake(&pl, &dl) {
        Ok(()) => {
            println!("pd handshake: prefill {prefill_name} and decode {decode_name} agree:");
            println!(
                "  {} layers (global {}..{})",
                pl.layers,
                pl.layer_base,
                pl.layer_base + pl.layers
            );
            println!("  KV pages {}", pl.kv);
            println!("  index-K pages {}", pl.index_k);
            println!(
                "  host mirror {}, scale_fmt {}",
                pl.host_layout.name(),
                pl.scale_fmt.name()
            );
            println!("  RoPE of the index keys: {}", pl.rope);
            0
        }
        Err(tierkv_engine::pd::HandshakeError::Layout { mismatches, .. }) => {
            let mut text = format!(
                "pd handshake refused: the prefill engine ({prefill_name}) and the decode engine \
                 ({decode_name}) disagree on the KV they would exchange, and tierkv converts no \
                 layout in transfer:"
            );
            for m in mismatches {
                text += &format!(
                    "\n  {}: prefill {}; decode {}",
                    m.field, m.prefill, m.decode
                );
            }
            CliError::Config(text).report()
        }
        Err(e) => CliError::Config(format!("pd handshake refused: {e}")).report(),
    }
}

pub fn run(file: Option<&PathBuf>, preset: Option<&str>, emit_toml: bool) -> i32 {
    let cfg = match super::load_config(file, preset) {
        Ok(c) => c,
        Err(e) => return e.report(),
    };
    if emit_toml {
        print!("{}", cfg.to_documented_toml());
        return 0;
    }
    let l = match cfg.layout() {
        Ok(l) => l,
        Err(e) => return CliError::Config(format!("invalid configuration: {e}")).report(),
    };
    let m = &cfg.model;
    println!("config {}: valid", cfg.name);
    println!(
        "model: {} layers (global {}..{}), index_n_heads {}, index_head_dim {}, index_topk {}, page_size {}",
        m.layers, m.layer_base, m.layer_base + m.layers, m.index_n_heads, m.index_head_dim, m.index_topk, m.page_size
    );
    println!(
        "rope: theta {}, {}; scale_fmt {}",
        m.rope_theta,
        yarn_line(&cfg),
        m.scale_fmt.name()
    );
    print_provenance(&cfg, file, preset);
    for kind in BufferKind::ALL {
        let fmt = l.format(kind);
        println!(
            "{:<8} {:<16} {:>5} B/token/layer  {:>6} B/page",
            kind.name(),
            fmt.to_string(),
            l.token_bytes(kind).0,
            l.page_bytes(kind).0
        );
    }
    println!(
        "device tier: {} pages = {} tokens",
        l.device_pages(),
        l.device_tokens().0
    );
    for kind in BufferKind::ALL {
        println!(
            "  {:<8} {} per layer, {} all layers",
            kind.name(),
            human(l.device_layer_bytes(kind).0),
            human(l.device_bytes(kind).0)
        );
    }
    println!("  total    {}", human(l.device_total_bytes().0));
    println!(
        "host tier ({}): {} pages = {} tokens",
        cfg.cache.host_layout.name(),
        l.host_pages(),
        l.host_tokens().0
    );
    for kind in BufferKind::ALL {
        println!("  {:<8} {}", kind.name(), human(l.host_bytes(kind).0));
    }
    println!("  total    {}", human(l.host_total_bytes().0));
    println!(
        "cache: write_policy {}, load_slots {}; scheduler: queued_requests_max {}, pending_tokens_max {}",
        cfg.cache.write_policy.name(), cfg.cache.load_slots,
        cfg.scheduler.queued_requests_max, cfg.scheduler.pending_tokens_max
    );
    0
}

/// Where the base preset's model values come from, and every unconfirmed one the configuration
/// still holds.
fn print_provenance(cfg: &Config, file: Option<&PathBuf>, preset: Option<&str>) {
    let base = match (file, preset) {
        (Some(f), _) => Config::base_preset_of(f),
        (None, Some(p)) => Some(p.to_string()),
        (None, None) => Some(Config::DEFAULT_PRESET.to_string()),
    };
    let Some(base) = base else {
        return;
    };
    let Some(src) = Config::preset_source(&base) else {
        return;
    };
    println!("preset {base}: {}", src.source);
    for (key, value, why) in cfg.unconfirmed(&base) {
        println!("  unconfirmed: {key} = {value}: {why}");
    }
}

/// Whether YaRN applies to `cfg`'s RoPE, and why.
fn yarn_line(cfg: &Config) -> String {
    let m = &cfg.model;
    if cfg.rope().yarn() {
        format!(
            "YaRN factor {} (rope_yarn {}; original_seq_len {}, context {}, beta_fast {}, \
             beta_slow {})",
            m.rope_factor,
            m.rope_yarn.name(),
            m.rope_original_seq_len,
            m.context_tokens_max,
            m.rope_beta_fast,
            m.rope_beta_slow
        )
    } else {
        format!(
            "no YaRN (rope_yarn {}: factor {}, context {}, original_seq_len {})",
            m.rope_yarn.name(),
            m.rope_factor,
            m.context_tokens_max,
            m.rope_original_seq_len
        )
    }
}
