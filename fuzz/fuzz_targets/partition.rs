#![no_main]

libfuzzer_sys::fuzz_target!(|input: blockswap_fuzz::partition::Input| {
    blockswap_fuzz::partition::check(&input);
});
