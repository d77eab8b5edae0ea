#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tierkv_engine::config::fuzz_config(data);
});
