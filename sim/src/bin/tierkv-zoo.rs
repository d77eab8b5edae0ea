//! `tierkv-zoo`: the `tierkv` command line built with the bug zoo's mutants (`--features
//! mutants`), under its own name so that building it never replaces the plain `tierkv`.

fn main() {
    std::process::exit(tierkv_sim::cli::main());
}
