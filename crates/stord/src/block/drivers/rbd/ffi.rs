//! The part of librados' and librbd's C API the rbd driver uses, declared by hand (the
//! handles are opaque pointers; every call is documented in librbd.h and librados.h) and
//! looked up at run time, and the safe wrappers over it: a connected cluster with its I/O
//! context, an open image, and asynchronous requests whose completions librbd delivers on
//! its own threads.
//!
//! The libraries are opened (dlopen) when the first rbd node opens or an rbd image is
//! created, as QEMU loads its rbd driver as a module: stord builds and runs without Ceph's
//! packages, and only `driver=rbd` needs them ([`load`] says which package is missing).
//!
//! Every `unsafe` of the driver is here. The rules that make it sound: each entry point's
//! Rust type is the C declaration's, and the libraries stay loaded for the process's life
//! once opened; a handle is used only between its successful creation and its release in
//! `Drop`; an asynchronous request's buffer and completion state are owned by an `Arc`
//! that the completion callback holds until librbd has called it, so a request future
//! dropped early frees nothing librbd may still write.

use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Poll, Waker};

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};

use crate::buf::Buf;

/// The Debian package that brings librbd.so.1 (and, as its dependency, librados.so.2).
pub const PACKAGE: &str = "librbd1";

/// Why librados or librbd could not be loaded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("rbd: cannot load {file} (install Debian's {PACKAGE} package): {why}")]
    Library { file: &'static str, why: String },
    #[error("rbd: {file} has no {symbol} (librbd 16 or later is needed): {why}")]
    Symbol {
        file: &'static str,
        symbol: &'static str,
        why: String,
    },
}

/// Declares the table of entry points ([`Api`]) and its loader from one list per library.
macro_rules! api {
    ($($file:literal => $lib:ident {
        $(fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*
    })*) => {
        /// librados' and librbd's entry points, looked up in the loaded libraries.
        pub struct Api {
            $($($name: unsafe extern "C" fn($($ty),*) -> $ret,)*)*
            /// The libraries the pointers point into, never closed.
            _libs: Vec<Library>,
        }

        impl Api {
            fn open() -> Result<Api, LoadError> {
                $(let $lib = open_library($file)?;)*
                Ok(Api {
                    $($($name: symbol(&$lib, $file, stringify!($name))?,)*)*
                    _libs: vec![$($lib),*],
                })
            }
        }
    };
}

/// Opens a library by its soname, resolving every symbol now (a librbd too old or broken
/// fails here, not at its first call).
fn open_library(file: &'static str) -> Result<Library, LoadError> {
    // SAFETY: librados and librbd run no initialisers that could break this process's
    // invariants (they start no threads before rados_create); the library is kept open for
    // the process's life, so nothing unloads it under a pointer taken from it.
    unsafe { Library::open(Some(file), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| LoadError::Library {
        file,
        why: e.to_string(),
    })
}

/// The entry point `name` of `lib`, as the function pointer type `T`.
fn symbol<T: Copy>(lib: &Library, file: &'static str, name: &'static str) -> Result<T, LoadError> {
    // SAFETY: `T` is the function pointer type `api!` declares for `name`, which is the C
    // declaration of librados.h/librbd.h; the pointer is copied out and used only while
    // the library stays loaded, which is forever (`Api` keeps it).
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| LoadError::Symbol {
            file,
            symbol: name,
            why: e.to_string(),
        })
}

/// librados and librbd, loaded at the first call (and only then); later calls answer
/// from the first one's outcome.
pub fn load() -> Result<&'static Api, LoadError> {
    static API: OnceLock<Result<Api, LoadError>> = OnceLock::new();
    API.get_or_init(Api::open).as_ref().map_err(Clone::clone)
}

type RadosT = *mut c_void;
type IoCtxT = *mut c_void;
type ImageT = *mut c_void;
type CompletionT = *mut c_void;
type Callback = extern "C" fn(CompletionT, *mut c_void);
type DiffCallback = extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;

/// librbd's `rbd_image_info_t`.
#[repr(C)]
struct ImageInfo {
    size: u64,
    obj_size: u64,
    num_objs: u64,
    order: c_int,
    block_name_prefix: [c_char; 24],
    parent_pool: i64,
    parent_name: [c_char; 96],
}

// The entry points, in one list: the table's fields and what loads them come from it.
api! {
    "librados.so.2" => rados {
        fn rados_create(cluster: *mut RadosT, id: *const c_char) -> c_int;
        fn rados_conf_read_file(cluster: RadosT, path: *const c_char) -> c_int;
        fn rados_conf_set(cluster: RadosT, option: *const c_char, value: *const c_char) -> c_int;
        fn rados_connect(cluster: RadosT) -> c_int;
        fn rados_shutdown(cluster: RadosT) -> ();
        fn rados_ioctx_create(cluster: RadosT, pool: *const c_char, io: *mut IoCtxT) -> c_int;
        fn rados_ioctx_set_namespace(io: IoCtxT, nspace: *const c_char) -> ();
        fn rados_ioctx_destroy(io: IoCtxT) -> ();
    }
    "librbd.so.1" => rbd {
        fn rbd_create(io: IoCtxT, name: *const c_char, size: u64, order: *mut c_int) -> c_int;
        fn rbd_open(io: IoCtxT, name: *const c_char, image: *mut ImageT, snap: *const c_char) -> c_int;
        fn rbd_open_read_only(
            io: IoCtxT,
            name: *const c_char,
            image: *mut ImageT,
            snap: *const c_char
        ) -> c_int;
        fn rbd_close(image: ImageT) -> c_int;
        fn rbd_stat(image: ImageT, info: *mut ImageInfo, len: usize) -> c_int;
        fn rbd_resize(image: ImageT, size: u64) -> c_int;
        fn rbd_get_features(image: ImageT, features: *mut u64) -> c_int;
        fn rbd_get_flags(image: ImageT, flags: *mut u64) -> c_int;
        fn rbd_diff_iterate2(
            image: ImageT,
            fromsnapname: *const c_char,
            ofs: u64,
            len: u64,
            include_parent: u8,
            whole_object: u8,
            cb: DiffCallback,
            arg: *mut c_void
        ) -> c_int;
        fn rbd_aio_create_completion(arg: *mut c_void, cb: Callback, c: *mut CompletionT) -> c_int;
        fn rbd_aio_get_return_value(c: CompletionT) -> isize;
        fn rbd_aio_release(c: CompletionT) -> ();
        fn rbd_aio_read(image: ImageT, off: u64, len: usize, buf: *mut c_char, c: CompletionT) -> c_int;
        fn rbd_aio_write(
            image: ImageT,
            off: u64,
            len: usize,
            buf: *const c_char,
            c: CompletionT
        ) -> c_int;
        fn rbd_aio_discard(image: ImageT, off: u64, len: u64, c: CompletionT) -> c_int;
        fn rbd_aio_write_zeroes(
            image: ImageT,
            off: u64,
            len: usize,
            c: CompletionT,
            zero_flags: c_int,
            op_flags: c_int
        ) -> c_int;
        fn rbd_aio_flush(image: ImageT, c: CompletionT) -> c_int;
    }
}

/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: zeroes that keep their storage allocated.
pub const WRITE_ZEROES_THICK: c_int = 1;

/// `RBD_FEATURE_FAST_DIFF`: the image keeps an object map that says which objects exist.
const FEATURE_FAST_DIFF: u64 = 1 << 4;
/// `RBD_FLAG_FAST_DIFF_INVALID`: that map cannot be trusted (rebuild it with
/// `rbd object-map rebuild`).
const FLAG_FAST_DIFF_INVALID: u64 = 1 << 1;
/// What the diff callback returns to stop the walk early (any negative value does; this
/// one is no errno).
const DIFF_STOP: c_int = -0x5354;

/// A negative errno from librados/librbd as an io::Error.
fn errno(r: impl Into<i64>) -> io::Error {
    io::Error::from_raw_os_error(-(r.into() as i32))
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a name"))
}

/// A step of connecting that failed, with librados' errno (QEMU words each step).
#[derive(Debug)]
pub struct ConnectError {
    pub step: String,
    pub err: io::Error,
}

/// A connected cluster handle and an I/O context on one pool.
pub struct Cluster {
    api: &'static Api,
    cluster: RadosT,
    io: IoCtxT,
}

// SAFETY: librados handles may be used from any thread (the library locks internally);
// `Cluster` hands out no interior pointers.
unsafe impl Send for Cluster {}
// SAFETY: as above: concurrent calls on one handle are allowed by librados.
unsafe impl Sync for Cluster {}

/// How to reach a cluster and which pool to use.
pub struct ConnectOptions<'a> {
    pub user: Option<&'a str>,
    pub conf: Option<&'a str>,
    /// `(option, value)` pairs set after the conf file (mon_host, key, auth_client_required).
    pub settings: Vec<(&'static str, String)>,
    pub pool: &'a str,
    pub namespace: Option<&'a str>,
}

impl Cluster {
    /// Connects (blocking: the monitors answer or librados times out).
    pub fn connect(api: &'static Api, o: &ConnectOptions<'_>) -> Result<Cluster, ConnectError> {
        let fail = |step: String, r: c_int| ConnectError {
            step,
            err: errno(r),
        };
        let bad = |step: &str, e: io::Error| ConnectError {
            step: step.into(),
            err: e,
        };
        let user = o.user.map(cstr).transpose().map_err(|e| bad("user", e))?;
        let mut cluster: RadosT = std::ptr::null_mut();
        // SAFETY: `cluster` is a valid out-pointer; `user` outlives the call (or is null).
        let r = unsafe {
            (api.rados_create)(
                &mut cluster,
                user.as_ref().map_or(std::ptr::null(), |u| u.as_ptr()),
            )
        };
        if r < 0 {
            return Err(fail("error initializing".into(), r));
        }
        // From here on `c` owns the handle (shut down on every error path by Drop).
        let mut c = Cluster {
            api,
            cluster,
            io: std::ptr::null_mut(),
        };
        let conf = o.conf.map(cstr).transpose().map_err(|e| bad("conf", e))?;
        // SAFETY: a live cluster handle; the path outlives the call (null: the default
        // locations, whose absence is not an error, as QEMU treats it).
        let r = unsafe {
            (api.rados_conf_read_file)(
                c.cluster,
                conf.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            )
        };
        if let (Some(path), true) = (o.conf, r < 0) {
            return Err(fail(format!("error reading conf file {path}"), r));
        }
        for (k, v) in &o.settings {
            let (kc, vc) = (
                cstr(k).map_err(|e| bad(k, e))?,
                cstr(v).map_err(|e| bad(k, e))?,
            );
            // SAFETY: a live handle; both strings outlive the call.
            let r = unsafe { (api.rados_conf_set)(c.cluster, kc.as_ptr(), vc.as_ptr()) };
            if r < 0 {
                return Err(fail(format!("error setting {k}"), r));
            }
        }
        // SAFETY: a live handle, configured.
        let r = unsafe { (api.rados_connect)(c.cluster) };
        if r < 0 {
            return Err(fail("error connecting".into(), r));
        }
        let pool = cstr(o.pool).map_err(|e| bad("pool", e))?;
        // SAFETY: a connected handle; `c.io` is a valid out-pointer; `pool` outlives it.
        let r = unsafe { (api.rados_ioctx_create)(c.cluster, pool.as_ptr(), &mut c.io) };
        if r < 0 {
            c.io = std::ptr::null_mut();
            return Err(fail(format!("error opening pool {}", o.pool), r));
        }
        if let Some(ns) = o.namespace {
            let nsc = cstr(ns).map_err(|e| bad("namespace", e))?;
            // SAFETY: a live I/O context; librados copies the name.
            unsafe { (api.rados_ioctx_set_namespace)(c.io, nsc.as_ptr()) };
        }
        Ok(c)
    }

    /// Opens `name` (at snapshot `snap`), read-only or not.
    pub fn open(
        self: &Arc<Self>,
        name: &str,
        snap: Option<&str>,
        read_only: bool,
    ) -> io::Result<Image> {
        let n = cstr(name)?;
        let s = snap.map(cstr).transpose()?;
        let api = self.api;
        let mut img: ImageT = std::ptr::null_mut();
        let sp = s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        // SAFETY: a live I/O context; out-pointer valid; strings outlive the call.
        let r = unsafe {
            if read_only {
                (api.rbd_open_read_only)(self.io, n.as_ptr(), &mut img, sp)
            } else {
                (api.rbd_open)(self.io, n.as_ptr(), &mut img, sp)
            }
        };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(Image {
            api,
            img,
            _cluster: self.clone(),
        })
    }

    /// Creates image `name` of `size` bytes, with objects of 2^`order` bytes (0: librbd's
    /// default).
    pub fn create(&self, name: &str, size: u64, order: u32) -> io::Result<()> {
        let n = cstr(name)?;
        let api = self.api;
        let mut order = order as c_int;
        // SAFETY: a live I/O context; the name and out-pointer outlive the call.
        let r = unsafe { (api.rbd_create)(self.io, n.as_ptr(), size, &mut order) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let api = self.api;
        // SAFETY: the handles were created by us and are released once, I/O context first;
        // every Image holds an Arc of this Cluster, so none is still open.
        unsafe {
            if !self.io.is_null() {
                (api.rados_ioctx_destroy)(self.io);
            }
            (api.rados_shutdown)(self.cluster);
        }
    }
}

/// An open image.
pub struct Image {
    api: &'static Api,
    img: ImageT,
    _cluster: Arc<Cluster>,
}

// SAFETY: librbd allows concurrent calls on one image handle from any thread (its aio
// entry points queue to the image's own work queue).
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

/// How long dropping an image waits for `rbd_close` (which waits for the requests in
/// flight: with an OSD down, as long as the OSD stays down).
pub const CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// An image handle on its way to `rbd_close` on another thread.
struct Closing(ImageT);

// SAFETY: librbd allows rbd_close from any thread; the handle moves to the closing
// thread and nothing else uses it after.
unsafe impl Send for Closing {}

impl Drop for Image {
    /// Closes on a thread of its own and waits for it at most [`CLOSE_LIMIT`]: past that
    /// the caller (a loop, or the daemon's stop) goes on and the close finishes whenever
    /// the cluster answers, or never if the process exits first.
    fn drop(&mut self) {
        let api = self.api;
        let img = Arc::new(Mutex::new(Some(Closing(self.img))));
        let close = move |img: &Mutex<Option<Closing>>| {
            if let Some(h) = img.lock().unwrap_or_else(|e| e.into_inner()).take() {
                // SAFETY: opened by us, closed once (taken out of the Option, never used
                // again); rbd_close waits for requests in flight, whose buffers their
                // completion states own.
                unsafe { (api.rbd_close)(h.0) };
            }
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (theirs, cluster) = (img.clone(), self._cluster.clone());
        let spawned = std::thread::Builder::new()
            .name("rbd-close".into())
            .spawn(move || {
                let _pending = crate::block::helper_thread::PendingClose::new();
                close(&theirs);
                drop(cluster);
                let _ = tx.send(());
            });
        if spawned.is_err() {
            // No thread to close on: close here.
            close(&img);
            return;
        }
        if rx.recv_timeout(CLOSE_LIMIT).is_err() {
            tracing::warn!(
                "an rbd image did not close within {CLOSE_LIMIT:?} (requests still waiting \
                 for the cluster); going on without it"
            );
        }
    }
}

/// What a request's completion callback and its future share.
struct Shared {
    api: &'static Api,
    st: Mutex<SharedState>,
}

struct SharedState {
    ret: Option<isize>,
    buf: Option<Buf>,
    waker: Option<Waker>,
}

impl Shared {
    /// The buffer back from a request librbd never took.
    fn take_buf(&self) -> Option<Buf> {
        self.st.lock().unwrap_or_else(|e| e.into_inner()).buf.take()
    }
}

extern "C" fn on_complete(c: CompletionT, arg: *mut c_void) {
    // SAFETY: `arg` is the `Arc::into_raw` made for this completion in `submit`; librbd
    // calls this once per completion, so the reference is taken back exactly once.
    let shared = unsafe { Arc::from_raw(arg as *const Shared) };
    let api = shared.api;
    // SAFETY: `c` is the completion this callback was registered with; it is released
    // here, after its value was read, and never used again.
    let ret = unsafe {
        let r = (api.rbd_aio_get_return_value)(c);
        (api.rbd_aio_release)(c);
        r
    };
    let waker = {
        let mut st = shared.st.lock().unwrap_or_else(|e| e.into_inner());
        st.ret = Some(ret);
        st.waker.take()
    };
    if let Some(w) = waker {
        // Hands the task back to its loop (a cross-thread wake-up: librbd's thread is
        // not the loop's).
        w.wake();
    }
}

/// The first extent of a range as `rbd_diff_iterate2` reports allocated extents in order.
struct DiffWalk {
    start: u64,
    end: u64,
    /// The allocated run found so far; or, with `allocated` false after a stop, its end is
    /// where the first allocated byte is.
    run: std::ops::Range<u64>,
    allocated: bool,
}

extern "C" fn on_diff_extent(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `DiffWalk` that `first_extent` passed, alive and not otherwise
    // borrowed while librbd runs its walk (which calls us on the caller's thread).
    let w = unsafe { &mut *arg.cast::<DiffWalk>() };
    if exists == 0 {
        return 0;
    }
    // Whole objects may start before or end after the range.
    let (s, e) = (off.max(w.start), off.saturating_add(len as u64).min(w.end));
    if e <= s {
        return 0;
    }
    if w.allocated {
        if s > w.run.end {
            return DIFF_STOP; // a hole after the allocated run
        }
        w.run.end = w.run.end.max(e);
        return 0;
    }
    if s > w.start {
        // A hole first, up to here.
        w.run = s..s;
        return DIFF_STOP;
    }
    w.run = s..e;
    w.allocated = true;
    0
}

/// An asynchronous request.
enum Op {
    Read(u64),
    Write(u64),
    Discard(u64, u64),
    WriteZeroes(u64, u64, c_int),
    Flush,
}

impl Image {
    /// Size and object size.
    pub fn stat(&self) -> io::Result<(u64, u64)> {
        // SAFETY: all-zero bytes are a valid ImageInfo (integers and char arrays).
        let mut info: ImageInfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<ImageInfo>();
        // SAFETY: an open image; `info` is a valid out-pointer of the size we pass.
        let r = unsafe { (self.api.rbd_stat)(self.img, &mut info, size) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok((info.size, info.obj_size))
    }

    /// Whether the first extent of `[off, off + len)` is allocated, and its length, from
    /// the object map (whole objects; a clone's parent counts); `None` when the image
    /// cannot tell (no fast-diff, or its map is flagged invalid). Blocking: the map may
    /// have to be read from the cluster. The walk starts at the object's start, as QEMU's
    /// does (librbd before 16.2.8 misreported walks from inside an object).
    pub fn first_extent(
        &self,
        off: u64,
        len: u64,
        object_size: u64,
    ) -> io::Result<Option<(bool, u64)>> {
        let (mut features, mut flags) = (0u64, 0u64);
        // SAFETY: an open image; valid out-pointers.
        let r = unsafe { (self.api.rbd_get_features)(self.img, &mut features) };
        if r < 0 {
            return Err(errno(r));
        }
        if features & FEATURE_FAST_DIFF == 0 {
            return Ok(None);
        }
        // SAFETY: as above.
        let r = unsafe { (self.api.rbd_get_flags)(self.img, &mut flags) };
        if r < 0 {
            return Err(errno(r));
        }
        if flags & FLAG_FAST_DIFF_INVALID != 0 {
            return Ok(None);
        }
        let mut walk = DiffWalk {
            start: off,
            end: off + len,
            run: off..off,
            allocated: false,
        };
        let from = off - off % object_size.max(1);
        // SAFETY: an open image; `walk` outlives the call, which invokes the callback
        // only before it returns, on this thread.
        let r = unsafe {
            (self.api.rbd_diff_iterate2)(
                self.img,
                std::ptr::null(),
                from,
                off + len - from,
                1,
                1,
                on_diff_extent,
                (&mut walk as *mut DiffWalk).cast(),
            )
        };
        if r < 0 && r != DIFF_STOP {
            return Err(errno(r));
        }
        Ok(Some(match (walk.allocated, r) {
            (true, _) => (true, walk.run.end - walk.run.start),
            // The walk stopped at the first allocated byte past a hole.
            (false, DIFF_STOP) => (false, walk.run.end - walk.start),
            // Nothing allocated anywhere in the range.
            (false, _) => (false, len),
        }))
    }

    /// Changes the size (blocking).
    pub fn resize(&self, size: u64) -> io::Result<()> {
        // SAFETY: an open image.
        let r = unsafe { (self.api.rbd_resize)(self.img, size) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(())
    }

    /// Starts `op` (with `buf` for reads and writes, kept alive until librbd is done with
    /// it) and completes with librbd's return value and the buffer.
    async fn submit(&self, op: Op, buf: Option<Buf>) -> (io::Result<isize>, Option<Buf>) {
        let mut buf = buf;
        let ptr = buf
            .as_mut()
            .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
        let len = buf.as_ref().map_or(0, |b| b.len());
        let shared = Arc::new(Shared {
            api: self.api,
            st: Mutex::new(SharedState {
                ret: None,
                buf,
                waker: None,
            }),
        });
        let arg = Arc::into_raw(shared.clone()) as *mut c_void;
        let mut c: CompletionT = std::ptr::null_mut();
        // SAFETY: `arg` stays valid until on_complete takes it back; `c` is an out-pointer.
        let r = unsafe { (self.api.rbd_aio_create_completion)(arg, on_complete, &mut c) };
        if r < 0 {
            // SAFETY: the completion was not made: nobody else holds `arg`.
            drop(unsafe { Arc::from_raw(arg as *const Shared) });
            return (Err(errno(r)), shared.take_buf());
        }
        // SAFETY: an open image, a fresh completion, and for reads and writes `ptr` points
        // at `len` bytes of the buffer the shared state owns (its heap bytes do not move
        // with it) until the callback has run.
        let r = unsafe {
            match op {
                Op::Read(off) => (self.api.rbd_aio_read)(self.img, off, len, ptr.cast(), c),
                Op::Write(off) => {
                    (self.api.rbd_aio_write)(self.img, off, len, ptr.cast_const().cast(), c)
                }
                Op::Discard(off, n) => (self.api.rbd_aio_discard)(self.img, off, n, c),
                Op::WriteZeroes(off, n, flags) => {
                    (self.api.rbd_aio_write_zeroes)(self.img, off, n as usize, c, flags, 0)
                }
                Op::Flush => (self.api.rbd_aio_flush)(self.img, c),
            }
        };
        if r < 0 {
            // SAFETY: librbd refused the request, so it will not call back: the completion
            // and the callback's reference are ours to release.
            unsafe {
                (self.api.rbd_aio_release)(c);
                drop(Arc::from_raw(arg as *const Shared));
            }
            return (Err(errno(r)), shared.take_buf());
        }
        std::future::poll_fn(|cx| {
            let mut st = shared.st.lock().unwrap_or_else(|e| e.into_inner());
            match st.ret {
                Some(ret) => {
                    let buf = st.buf.take();
                    Poll::Ready((
                        if ret < 0 {
                            Err(errno(ret as i64))
                        } else {
                            Ok(ret)
                        },
                        buf,
                    ))
                }
                None => {
                    st.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }

    pub async fn read(&self, off: u64, buf: Buf) -> (io::Result<isize>, Buf) {
        let (r, b) = self.submit(Op::Read(off), Some(buf)).await;
        (r, b.expect("the buffer comes back"))
    }

    pub async fn write(&self, off: u64, buf: Buf) -> (io::Result<isize>, Buf) {
        let (r, b) = self.submit(Op::Write(off), Some(buf)).await;
        (r, b.expect("the buffer comes back"))
    }

    pub async fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.submit(Op::Discard(off, len), None).await.0.map(|_| ())
    }

    pub async fn write_zeroes(&self, off: u64, len: u64, thick: bool) -> io::Result<()> {
        let flags = if thick { WRITE_ZEROES_THICK } else { 0 };
        self.submit(Op::WriteZeroes(off, len, flags), None)
            .await
            .0
            .map(|_| ())
    }

    pub async fn flush(&self) -> io::Result<()> {
        self.submit(Op::Flush, None).await.0.map(|_| ())
    }
}
