//! The future every block request returns: boxed, and not `Send` (a request runs entirely
//! on the IoThread that issued it).

use std::future::Future;
use std::io;
use std::pin::Pin;

/// A request's future (not Send: it belongs to the issuing thread).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// A request the driver does not do: ENOTSUP, "Operation not supported".
pub(crate) fn unsupported_fut<'a, T: 'a>() -> BoxFut<'a, io::Result<T>> {
    Box::pin(std::future::ready(Err(io::Error::from_raw_os_error(
        libc::ENOTSUP,
    ))))
}
