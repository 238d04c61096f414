#![no_main]

libfuzzer_sys::fuzz_target!(|input: blockswap_fuzz::expand::Input| {
    blockswap_fuzz::expand::check(&input);
});
