//! A tls-creds-psk keys.psk file.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = stord::tls::psk::parse_keys(text);
    }
});
