#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tierkv_sim::fuzz::fuzz_guided(data));
