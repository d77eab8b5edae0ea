#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tierkv_kernels::layout::fuzz_layout_copy(data));
