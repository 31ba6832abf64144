#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gputrace_fuzz::decode(data));
