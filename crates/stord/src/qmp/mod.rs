//! The QMP monitor: qemu-storage-daemon's control protocol on a unix socket.
//!
//! Each connection gets the greeting, must negotiate with `qmp_capabilities`, then sends
//! `{"execute": ..., "arguments": ..., "id": ...}` and gets `{"return": ...}` or
//! `{"error": {"class", "desc"}}` with the id echoed. Events go to every negotiated
//! connection with a timestamp. Malformed JSON or a bad command gets an error object and
//! the connection stays usable. What one client can make the daemon hold is bounded: a
//! message over [`MAX_MESSAGE`] or nested deeper than [`stream::MAX_NESTING`] closes that
//! connection; once [`MAX_QUEUED`] bytes of replies wait for a client that does not read
//! them, its next command is not read until they drain, and a client that lets events pile
//! up beyond [`MAX_BACKLOG`] is disconnected. Connections run as tasks on the main loop.

mod commands;
pub mod error;
pub mod monitor;
pub mod stream;
pub mod text;

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::task::{Poll, Waker};

use serde_json::{json, Value};
use stord_aio::{op, Interest, Slice};

use crate::daemon::SharedState;
use crate::events::{EventSink, Events};
pub use error::QmpError;
use stream::{JsonStream, Piece};

/// Largest message a client may send (a bigger one closes its connection).
pub const MAX_MESSAGE: usize = 1 << 20;
/// Reply bytes waiting for a client beyond which its commands are not read.
pub const MAX_QUEUED: usize = 1 << 20;
/// Bytes waiting for a client (events, which do not wait for commands) beyond which it is
/// disconnected.
pub const MAX_BACKLOG: usize = 16 << 20;

/// What the connections of one monitor share: the `monitor-qmp` object it is (None: a
/// command-line monitor), whether it pretty-prints, and its connections now (a monitor
/// that goes disconnects them).
#[derive(Default)]
pub struct Session {
    pub id: Option<String>,
    pub pretty: bool,
    /// The chardev's log: what the monitor sends is written there too.
    log: Option<crate::chardev::log::SharedLog>,
    conns: RefCell<Vec<std::rc::Weak<Outbox>>>,
}

impl Session {
    /// A session for monitor `id` (None: the command line's).
    pub fn new(
        id: Option<String>,
        pretty: bool,
        log: Option<crate::chardev::log::SharedLog>,
    ) -> Rc<Self> {
        Rc::new(Session {
            id,
            pretty,
            log,
            conns: RefCell::default(),
        })
    }

    /// Disconnects every client (the monitor goes).
    pub fn disconnect_all(&self) {
        for c in self.conns.take() {
            if let Some(out) = c.upgrade() {
                out.close();
            }
        }
    }
}

/// Outgoing bytes of one connection, sent by its writer task.
pub(crate) struct Outbox {
    fd: RawFd,
    buf: RefCell<Vec<u8>>,
    waker: RefCell<Option<Waker>>,
    /// The reader waiting for queued replies to drain.
    reader_waker: RefCell<Option<Waker>>,
    closed: Cell<bool>,
    negotiated: Cell<bool>,
    /// The writer holds bytes it has not finished sending.
    sending: Cell<bool>,
    /// Bytes the writer holds and has not sent yet.
    in_writer: Cell<usize>,
    /// Told when everything queued has gone (the daemon waits for that at shutdown).
    events: Events,
    /// The reply to `quit`, sent once the stop has torn everything down (qsd's order).
    held: RefCell<Option<Value>>,
    /// Replies and events pretty-printed (`pretty=on`).
    pretty: bool,
    /// The `monitor-qmp` object this connection came through, if any.
    monitor: Option<String>,
    /// The chardev's log.
    log: Option<crate::chardev::log::SharedLog>,
}

impl Outbox {
    fn new(fd: RawFd, events: Events) -> Self {
        Self {
            pretty: false,
            monitor: None,
            log: None,
            events,
            fd,
            buf: RefCell::default(),
            waker: RefCell::default(),
            reader_waker: RefCell::default(),
            closed: Cell::new(false),
            negotiated: Cell::new(false),
            sending: Cell::new(false),
            in_writer: Cell::new(0),
            held: RefCell::default(),
        }
    }

    /// Bytes queued for the client and not sent yet.
    fn queued(&self) -> usize {
        self.buf.borrow().len() + self.in_writer.get()
    }

    fn send(&self, v: &Value) {
        if self.closed.get() {
            return;
        }
        let mut b = self.buf.borrow_mut();
        let text = if self.pretty {
            // Every line of it ends in CR LF, as QEMU's monitor_puts writes them.
            text::to_pretty_text(v).replace('\n', "\r\n")
        } else {
            text::to_text(v)
        };
        b.extend_from_slice(text.as_bytes());
        b.extend_from_slice(b"\r\n");
        if let Some(log) = &self.log {
            log.borrow_mut().write(&b[b.len() - text.len() - 2..]);
        }
        drop(b);
        if self.queued() > MAX_BACKLOG {
            tracing::warn!(
                "qmp: a client left over {} MiB unread; disconnecting it",
                MAX_BACKLOG >> 20
            );
            self.close();
            return;
        }
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Ends the connection: nothing more is sent, both tasks see the end.
    fn close(&self) {
        self.closed.set(true);
        self.buf.borrow_mut().clear();
        crate::sys::shutdown(self.fd);
        self.wake_all();
        self.events.sink_drained();
    }

    fn wake_all(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
        if let Some(w) = self.reader_waker.borrow_mut().take() {
            w.wake();
        }
    }
}

fn greeting() -> Value {
    json!({
        "QMP": {
            "version": crate::version::version_info(),
            "capabilities": [],
        }
    })
}

async fn write_loop(fd: RawFd, out: Rc<Outbox>) {
    loop {
        let data = std::future::poll_fn(|cx| {
            let mut b = out.buf.borrow_mut();
            if !b.is_empty() {
                return Poll::Ready(Some(std::mem::take(&mut *b)));
            }
            if out.closed.get() {
                return Poll::Ready(None);
            }
            *out.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        let Some(mut data) = data else { break };
        out.sending.set(true);
        out.in_writer.set(data.len());
        let mut off = 0;
        while off < data.len() {
            let n = data.len();
            let (r, s) = op::send(fd, Slice::new(data, off, n), 0).await;
            data = s.into_inner();
            match r {
                Ok(k) if k > 0 => {
                    off += k;
                    out.in_writer.set(n - off);
                    if let Some(w) = out.reader_waker.borrow_mut().take() {
                        w.wake();
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    if op::poll_add(fd, Interest::WRITABLE).await.is_err() {
                        out.in_writer.set(0);
                        out.close();
                        return;
                    }
                }
                _ => {
                    out.in_writer.set(0);
                    out.close();
                    return;
                }
            }
        }
        out.sending.set(false);
        if out.buf.borrow().is_empty() {
            out.events.sink_drained();
        }
    }
    out.events.sink_drained();
}

impl EventSink for Outbox {
    fn deliver(&self, event: &Value) {
        self.send(event);
    }

    fn listening(&self) -> bool {
        self.negotiated.get()
    }

    fn stopped(&self) {
        if let Some(reply) = self.held.borrow_mut().take() {
            self.send(&reply);
        }
    }

    fn flushed(&self) -> bool {
        self.closed.get() || (self.buf.borrow().is_empty() && !self.sending.get())
    }
}

async fn serve(conn: OwnedFd, state: SharedState, session: Rc<Session>) {
    let fd = conn.as_raw_fd();
    let events = state.borrow().events().clone();
    let mut outbox = Outbox::new(fd, events.clone());
    outbox.pretty = session.pretty;
    outbox.monitor = session.id.clone();
    outbox.log = session.log.clone();
    let out = Rc::new(outbox);
    session.conns.borrow_mut().push(Rc::downgrade(&out));
    let sink: Rc<dyn EventSink> = out.clone();
    events.subscribe(Rc::downgrade(&sink));
    let writer = stord_aio::spawn(write_loop(fd, out.clone()));
    out.send(&greeting());
    let mut stream = JsonStream::default();
    let mut buf = vec![0u8; 64 << 10];
    'conn: loop {
        let (k, b) = recv_some(fd, buf).await;
        buf = b;
        let Some(k) = k else { break };
        for piece in stream.push(&buf[..k]) {
            room_for_replies(&out).await;
            if out.closed.get() {
                break 'conn;
            }
            match answer(piece, &state, &out).await {
                Answer::Reply(r) => out.send(&r),
                Answer::Nothing => {}
                Answer::Close => break 'conn,
            }
        }
        if stream.pending() > MAX_MESSAGE {
            tracing::warn!("qmp: a message over {MAX_MESSAGE} bytes; closing that connection");
            break;
        }
    }
    out.closed.set(true);
    if let Some(w) = out.waker.borrow_mut().take() {
        w.wake();
    }
    writer.await;
    drop(conn);
    // A monitor made with close-action=delete goes with its client.
    if let Some(id) = &session.id {
        if let Ok(mut st) = state.try_borrow_mut() {
            st.monitor_closed(id);
        }
    }
}

/// Reads what the client sent into `buf`: the byte count, or None once the connection
/// is closed or failed.
async fn recv_some(fd: RawFd, buf: Vec<u8>) -> (Option<usize>, Vec<u8>) {
    let mut buf = buf;
    loop {
        let n = buf.len();
        let (r, s) = op::recv(fd, Slice::new(buf, 0, n), 0).await;
        buf = s.into_inner();
        match r {
            Ok(0) => return (None, buf),
            Ok(k) => return (Some(k), buf),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                if op::poll_add(fd, Interest::READABLE).await.is_err() {
                    return (None, buf);
                }
            }
            Err(_) => return (None, buf),
        }
    }
}

/// Waits while the replies the client has not read are over their limit: they hold up
/// its next commands.
async fn room_for_replies(out: &Outbox) {
    std::future::poll_fn(|cx| {
        if out.closed.get() || out.queued() < MAX_QUEUED {
            Poll::Ready(())
        } else {
            *out.reader_waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await
}

/// What one message of the stream gets.
enum Answer {
    Reply(Value),
    Nothing,
    /// The client broke a limit: its connection is closed.
    Close,
}

/// Answers one piece of the stream: a command's reply, a parse error, or the end of a
/// connection whose client sent more than a message may hold.
async fn answer(piece: Piece, state: &SharedState, out: &Rc<Outbox>) -> Answer {
    let text = match piece {
        Piece::Garbage(_) => {
            let e = QmpError::generic("JSON parse error, invalid token");
            return Answer::Reply(error_reply(None, &e));
        }
        Piece::TooDeep => {
            tracing::warn!(
                "qmp: a message nested deeper than {} levels; closing that connection",
                stream::MAX_NESTING
            );
            return Answer::Close;
        }
        Piece::Json(text) if text.len() > MAX_MESSAGE => {
            tracing::warn!("qmp: a message over {MAX_MESSAGE} bytes; closing that connection");
            return Answer::Close;
        }
        Piece::Json(text) => text,
    };
    match serde_json::from_slice::<Value>(&text) {
        Err(e) => {
            let e = QmpError::generic(format!("JSON parse error, {e}"));
            Answer::Reply(error_reply(None, &e))
        }
        Ok(v) => match handle(state, out, v).await {
            Some(r) => Answer::Reply(r),
            None => Answer::Nothing,
        },
    }
}

/// Commands the QMP fuzz target does not run: they listen on or remove paths the input
/// names (`nbd-server-start`, `block-export-add`, `blockdev-create`), start threads (`object-add` of an
/// iothread) or stop the process. Everything else runs against a daemon state of its own.
#[cfg(any(test, fuzzing))]
const FUZZ_SKIPPED: &[&str] = &[
    "nbd-server-start",
    "block-export-add",
    "blockdev-create",
    "quit",
];

/// Every command's name, in the order `query-commands` lists them (`qmp_capabilities`
/// first): what the man page lists.
pub fn command_names() -> impl Iterator<Item = &'static str> {
    std::iter::once("qmp_capabilities").chain(commands::COMMANDS.iter().map(|c| c.name))
}

/// Fuzz entry (`fuzz/fuzz_targets/qmp_commands.rs`): `data` as what a monitor client sends,
/// cut into texts by the real splitter, parsed and dispatched by the real request handler
/// and commands to a fresh daemon state (capabilities negotiation included). Each reply
/// must be a `return` or an `error` object.
#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub fn fuzz_commands(data: &[u8]) {
    let state: SharedState = Rc::new(RefCell::new(crate::daemon::State::default()));
    let Ok((ours, _theirs)) = std::os::unix::net::UnixStream::pair() else {
        return;
    };
    let out = Rc::new(Outbox::new(ours.as_raw_fd(), Events::default()));
    let mut stream = JsonStream::default();
    let mut msgs = Vec::new();
    for piece in stream.push(data) {
        let Piece::Json(text) = piece else { continue };
        let Ok(v) = serde_json::from_slice::<Value>(&text) else {
            continue;
        };
        let cmd = v.get("execute").and_then(Value::as_str).unwrap_or("");
        let iothread = v
            .get("arguments")
            .and_then(|a| a.get("qom-type"))
            .and_then(Value::as_str)
            == Some("iothread");
        if FUZZ_SKIPPED.contains(&cmd) || iothread {
            continue;
        }
        msgs.push(v);
    }
    crate::export::fuzz_loop::with_loop(|ctx| {
        ctx.block_on(async move {
            for v in msgs {
                let Some(reply) = handle(&state, &out, v).await else {
                    continue;
                };
                assert!(
                    reply.get("return").is_some() != reply.get("error").is_some(),
                    "a reply is a return or an error: {reply}"
                );
            }
            // Nodes and objects go as the daemon's shutdown would drop them.
            drop(state);
        })
    });
}

fn error_reply(id: Option<&Value>, e: &QmpError) -> Value {
    let mut v = json!({ "error": { "class": e.class, "desc": e.desc } });
    if let Some(id) = id {
        v["id"] = id.clone();
    }
    v
}

/// The command and its arguments out of a request (its `id` taken already), or QEMU's
/// words for a request of the wrong shape.
fn parse_request(
    obj: &mut serde_json::Map<String, Value>,
) -> Result<(String, serde_json::Map<String, Value>), QmpError> {
    if obj.contains_key("exec-oob") {
        return Err(QmpError::generic(
            "QMP input member 'exec-oob' is unexpected (out-of-band is not offered)",
        ));
    }
    let cmd = match obj.remove("execute") {
        Some(Value::String(c)) => c,
        Some(_) => {
            return Err(QmpError::generic(
                "QMP input member 'execute' must be a string",
            ))
        }
        None => return Err(QmpError::generic("QMP input lacks member 'execute'")),
    };
    let args = match obj.remove("arguments") {
        None => serde_json::Map::new(),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(QmpError::generic(
                "QMP input member 'arguments' must be an object",
            ))
        }
    };
    if let Some(k) = obj.keys().next() {
        return Err(QmpError::generic(format!(
            "QMP input member '{k}' is unexpected"
        )));
    }
    Ok((cmd, args))
}

async fn handle(state: &SharedState, out: &Rc<Outbox>, msg: Value) -> Option<Value> {
    let Value::Object(mut obj) = msg else {
        return Some(error_reply(
            None,
            &QmpError::generic("QMP input must be a JSON object"),
        ));
    };
    let id = obj.remove("id");
    let reply = |r: Result<Value, QmpError>| match r {
        Ok(v) => {
            let mut m = json!({ "return": v });
            if let Some(id) = &id {
                m["id"] = id.clone();
            }
            m
        }
        Err(e) => error_reply(id.as_ref(), &e),
    };
    let (cmd, args) = match parse_request(&mut obj) {
        Ok(request) => request,
        Err(e) => return Some(reply(Err(e))),
    };
    if !out.negotiated.get() {
        if cmd == "qmp_capabilities" {
            out.negotiated.set(true);
            return Some(reply(Ok(json!({}))));
        }
        return Some(reply(Err(QmpError {
            class: "CommandNotFound",
            desc: "Expecting capabilities negotiation with 'qmp_capabilities'".into(),
        })));
    }
    if cmd == "qmp_capabilities" {
        return Some(reply(Err(QmpError {
            class: "CommandNotFound",
            desc: "Capabilities negotiation is already complete, command ignored".into(),
        })));
    }
    // Once quit has been asked, nothing more runs (QEMU's main loop has ended by then).
    if state.borrow().quit_flag().get() {
        return None;
    }
    state.borrow_mut().set_current_monitor(out.monitor.clone());
    // QEMU's handle_qmp_command trace, with the arguments' names only: their values can
    // be secrets (`object-add` of a secret's data).
    let names: Vec<&str> = args.keys().map(String::as_str).collect();
    tracing::debug!("qmp: {cmd} ({})", names.join(", "));
    let r = commands::execute(state, &cmd, args);
    if cmd == "quit" && r.is_ok() {
        *out.held.borrow_mut() = Some(reply(r));
        return None;
    }
    Some(reply(r))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_fuzzed_session_replies_with_returns_and_errors() {
        super::fuzz_commands(
            br#"{"execute":"query-version"}
            {"execute":"qmp_capabilities"}
            {"execute":"blockdev-add","arguments":{"driver":"null-co","node-name":"n","size":1048576}}
            {"execute":"blockdev-add","arguments":{"driver":"null-co","node-name":"n","size":"x"}}
            {"execute":"object-add","arguments":{"qom-type":"secret","id":"s","data":"x"}}
            {"execute":"blockdev-reopen","arguments":{"options":[{"node-name":"n","read-only":true}]}}
            {"execute":"transaction","arguments":{"actions":[{"type":"abort"}]}}
            {"execute":"blockdev-del","arguments":{"node-name":"n"}}
            {"execute":["not a string"]} [1,2] {"id":7}"#,
        );
    }
}
