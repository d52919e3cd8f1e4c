//! The event loop the fuzz entry points run on: one per thread, created on first use and
//! kept (leaked) for the whole process, since a fuzzer runs millions of inputs and a loop
//! costs an io_uring to set up. Dropping it in a thread-local destructor would touch
//! thread-locals already gone, hence the leak.

use std::cell::Cell;

use stord_aio::AioContext;

thread_local! {
    static CTX: Cell<Option<&'static AioContext>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's fuzzing loop.
pub fn with_loop<T>(f: impl FnOnce(&AioContext) -> T) -> T {
    let ctx = CTX.with(|c| match c.get() {
        Some(ctx) => ctx,
        None => {
            let ctx: &'static AioContext =
                Box::leak(Box::new(AioContext::new(Default::default()).expect("loop")));
            c.set(Some(ctx));
            ctx
        }
    });
    f(ctx)
}
