//! qsd's key=value option syntax (and its JSON form), as --blockdev/--object/--export take it.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::cli::keyval::fuzz(data);
});
