//! vhost-user messages (fds attached where a message takes them: memfds for memory,
//! eventfds for vrings) to the real control loop of a one-queue disk.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    stord::export::vhost_user_blk::fuzz::messages(data);
});
