//! A QMP client's input, dispatched by the real request handler and commands to a daemon
//! state of its own (commands that listen on or remove paths are left out).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::qmp::fuzz_commands(data);
});
