#![no_main]

libfuzzer_sys::fuzz_target!(|input: blockswap_fuzz::prepare::Input| {
    blockswap_fuzz::prepare::check(&input);
});
