//! QMP input: the JSON stream splitter fed in pieces, and each text it yields parsed.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::qmp::stream::fuzz(data);
});
