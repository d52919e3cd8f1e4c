//! QMP events: what the daemon announces (BLOCK_EXPORT_DELETED, job and block job events),
//! fanned out to whoever listens.
//!
//! The daemon emits without knowing who listens; the QMP monitor subscribes each
//! negotiated connection as an [`EventSink`]. Keeping the fan-out here, below both, is what
//! lets the daemon layer and the monitor stay one above the other. At shutdown the daemon
//! tears down what it serves first (each export's BLOCK_EXPORT_DELETED, each job's
//! cancellation), then tells the sinks it has [`stopped`](Events::stopped) (a monitor sends
//! the reply to `quit` it held, last, as qsd does) and waits (woken, not polling) until
//! every sink has sent what it was given. Like qsd, stord has no SHUTDOWN event.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::task::{Poll, Waker};

use serde_json::{json, Value};

/// An event the daemon sends, for `query-qmp-schema`: its name and data members (QAPI
/// builtin type names; a name starting with `?` is optional, as QAPI marks it).
pub struct EventInfo {
    pub name: &'static str,
    pub members: &'static [(&'static str, &'static str)],
}

/// Every event stord sends.
pub const EVENTS: &[EventInfo] = &[
    EventInfo {
        name: "BLOCK_EXPORT_DELETED",
        members: &[("id", "str")],
    },
    EventInfo {
        name: "JOB_STATUS_CHANGE",
        members: &[("id", "str"), ("status", "any")],
    },
    EventInfo {
        name: "BLOCK_JOB_COMPLETED",
        members: &[
            ("type", "any"),
            ("device", "str"),
            ("len", "int"),
            ("offset", "int"),
            ("speed", "int"),
            ("?error", "str"),
        ],
    },
    EventInfo {
        name: "BLOCK_JOB_CANCELLED",
        members: BLOCK_JOB_MEMBERS,
    },
    EventInfo {
        name: "BLOCK_JOB_READY",
        members: BLOCK_JOB_MEMBERS,
    },
    EventInfo {
        name: "BLOCK_JOB_PENDING",
        members: &[("type", "any"), ("id", "str")],
    },
    EventInfo {
        name: "BLOCK_WRITE_THRESHOLD",
        members: &[
            ("node-name", "str"),
            ("amount-exceeded", "int"),
            ("write-threshold", "int"),
        ],
    },
    EventInfo {
        name: "BLOCK_JOB_ERROR",
        members: &[("device", "str"), ("operation", "any"), ("action", "any")],
    },
];

/// The data of BLOCK_JOB_CANCELLED and _READY (BLOCK_JOB_COMPLETED adds `error`).
const BLOCK_JOB_MEMBERS: &[(&str, &str)] = &[
    ("type", "any"),
    ("device", "str"),
    ("len", "int"),
    ("offset", "int"),
    ("speed", "int"),
];

/// A receiver of events (one QMP connection).
pub trait EventSink {
    /// Queues one event for sending.
    fn deliver(&self, event: &Value);
    /// Whether it wants events now (a QMP connection does once negotiated).
    fn listening(&self) -> bool;
    /// Whether everything it was given has been sent (or it is closed).
    fn flushed(&self) -> bool;
    /// The daemon's stop has torn down what it served: what was held until then (the
    /// reply to `quit`) goes now.
    fn stopped(&self) {}
}

#[derive(Default)]
struct Inner {
    sinks: RefCell<Vec<Weak<dyn EventSink>>>,
    /// Who waits in [`Events::all_flushed`].
    flush_waiter: RefCell<Option<Waker>>,
}

/// The fan-out: cheap to clone, main thread only.
#[derive(Clone, Default)]
pub struct Events(Rc<Inner>);

thread_local! {
    /// The fan-out of the loop this thread runs, for events posted from other threads.
    static POSTED_TO: RefCell<Option<Events>> = const { RefCell::new(None) };
}

/// Sends events from any thread (a node's BLOCK_WRITE_THRESHOLD, raised by whichever
/// thread wrote): each goes to the loop that made the poster and out from there.
#[derive(Clone)]
pub struct EventPoster {
    main: stord_aio::Remote,
}

impl EventPoster {
    /// Emits on the loop that made the poster, soon: posted through its queue, behind
    /// whatever this thread posted or woke there before.
    pub fn emit(&self, name: &'static str, data: Value) {
        self.main.call(move || {
            POSTED_TO.with(|e| {
                if let Some(e) = &*e.borrow() {
                    e.emit(name, data);
                }
            })
        });
    }

    /// Emits now when called on the loop that made the poster (in order with what that
    /// loop emits itself), else as [`emit`](Self::emit).
    pub fn emit_here_or_post(&self, name: &'static str, data: Value) {
        if !self.main.is_current() {
            return self.emit(name, data);
        }
        POSTED_TO.with(|e| {
            if let Some(e) = &*e.borrow() {
                e.emit(name, data);
            }
        })
    }
}

impl Events {
    /// A poster for these events (None off a loop): called on the thread that owns them.
    pub fn poster(&self) -> Option<EventPoster> {
        POSTED_TO.with(|e| *e.borrow_mut() = Some(self.clone()));
        stord_aio::with_current_context(|c| EventPoster { main: c.remote() })
    }

    /// Sends `{"event": name, "data": data, "timestamp": ...}` to every listening sink.
    pub fn emit(&self, name: &str, data: Value) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ev = json!({
            "event": name,
            "data": data,
            "timestamp": { "seconds": now.as_secs(), "microseconds": now.subsec_micros() },
        });
        // Collected first: a sink may drop itself (and so the list) while delivering.
        let sinks: Vec<Rc<dyn EventSink>> = {
            let mut list = self.0.sinks.borrow_mut();
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for s in sinks.iter().filter(|s| s.listening()) {
            s.deliver(&ev);
        }
    }

    /// Adds a sink; it leaves when it is dropped.
    pub fn subscribe(&self, sink: Weak<dyn EventSink>) {
        self.0.sinks.borrow_mut().push(sink);
    }

    /// Whether every sink has sent all it was given.
    pub fn flushed(&self) -> bool {
        self.0
            .sinks
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .all(|s| s.flushed())
    }

    /// A sink calls this when it has sent everything or closed, waking
    /// [`all_flushed`](Self::all_flushed).
    pub fn sink_drained(&self) {
        if let Some(w) = self.0.flush_waiter.borrow_mut().take() {
            w.wake();
        }
    }

    /// Tells every sink the daemon's stop has torn down what it served.
    pub fn stopped(&self) {
        let sinks: Vec<Rc<dyn EventSink>> = self
            .0
            .sinks
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for s in sinks {
            s.stopped();
        }
    }

    /// Completes once every sink has sent what it was given.
    pub async fn all_flushed(&self) {
        std::future::poll_fn(|cx| {
            if self.flushed() {
                return Poll::Ready(());
            }
            *self.0.flush_waiter.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// A sink that keeps what it is given, for tests.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Recorder {
    pub(crate) got: RefCell<Vec<Value>>,
    pub(crate) listening: std::cell::Cell<bool>,
}

#[cfg(test)]
impl Recorder {
    /// A listening recorder subscribed to `events` (it leaves when dropped).
    pub(crate) fn listen(events: &Events) -> Rc<Recorder> {
        let r = Rc::new(Recorder::default());
        r.listening.set(true);
        events.subscribe(Rc::downgrade(&r) as Weak<dyn EventSink>);
        r
    }
}

#[cfg(test)]
impl EventSink for Recorder {
    fn deliver(&self, event: &Value) {
        self.got.borrow_mut().push(event.clone());
    }
    fn listening(&self) -> bool {
        self.listening.get()
    }
    fn flushed(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Sink = Recorder;

    #[test]
    fn only_listening_sinks_get_events_and_dropped_ones_leave() {
        let events = Events::default();
        let a = Rc::new(Sink::default());
        let b = Rc::new(Sink::default());
        a.listening.set(true);
        let aw: Weak<dyn EventSink> = Rc::downgrade(&a) as Weak<dyn EventSink>;
        let bw: Weak<dyn EventSink> = Rc::downgrade(&b) as Weak<dyn EventSink>;
        events.subscribe(aw);
        events.subscribe(bw);
        events.emit("X", json!({ "k": 1 }));
        assert_eq!(a.got.borrow().len(), 1);
        assert_eq!(a.got.borrow()[0]["event"], "X");
        assert_eq!(a.got.borrow()[0]["data"]["k"], 1);
        assert!(b.got.borrow().is_empty());
        drop(a);
        events.emit("Y", json!({}));
        assert_eq!(events.0.sinks.borrow().len(), 1);
    }
}
