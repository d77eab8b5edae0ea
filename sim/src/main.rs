//! The `tierkv` command line. See `tierkv --help`.

fn main() {
    std::process::exit(tierkv_sim::cli::main());
}
