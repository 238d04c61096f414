#![no_main]

libfuzzer_sys::fuzz_target!(|input: blockswap_fuzz::disjoint::Input| {
    blockswap_fuzz::disjoint::check(&input);
});
