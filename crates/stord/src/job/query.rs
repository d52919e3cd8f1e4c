//! `query-jobs` and `query-block-jobs`: each job as QEMU shows it, newest first.

use std::sync::atomic::Ordering::SeqCst;

use serde_json::{json, Value};

use super::handle::{lock, Job};
use super::status::JobStatus;
use super::table::Jobs;

impl Job {
    fn info(&self) -> Value {
        let (cur, total) = *lock(&self.progress);
        let mut v = json!({
            "id": self.id,
            "type": self.kind,
            "status": self.status().name(),
            "current-progress": cur,
            "total-progress": total,
        });
        if let Some(e) = &*lock(&self.error) {
            v["error"] = e.clone().into();
        }
        v
    }

    fn block_info(&self) -> Value {
        let (cur, total) = *lock(&self.progress);
        let s = self.status();
        let mut v = json!({
            "type": self.kind,
            "device": self.id,
            "len": total,
            "offset": cur,
            "busy": !self.idle.load(SeqCst),
            "paused": self.pause_count() > 0,
            "speed": self.speed.load(SeqCst),
            "io-status": if self.io_failed.load(SeqCst) { "failed" } else { "ok" },
            "ready": matches!(s, JobStatus::Ready | JobStatus::Standby),
            "status": s.name(),
            "auto-finalize": self.auto_finalize,
            "auto-dismiss": self.auto_dismiss,
        });
        if let Some(e) = &*lock(&self.error) {
            v["error"] = e.clone().into();
        }
        let ext = lock(&self.ext).clone();
        if let (Some(t), Value::Object(m)) = (ext, &mut v) {
            t.query(m);
        }
        v
    }
}

impl Jobs {
    /// `query-jobs`: newest first.
    pub fn query(&self) -> Value {
        self.list(|j| Some(j.info()))
    }

    /// `query-block-jobs`: the block jobs, newest first.
    pub fn query_block(&self) -> Value {
        self.list(|j| j.block.then(|| j.block_info()))
    }

    fn list(&self, f: impl Fn(&Job) -> Option<Value>) -> Value {
        let map = self.map.borrow();
        Value::Array(
            self.order
                .borrow()
                .iter()
                .rev()
                .filter_map(|id| map.get(id).and_then(|j| f(j)))
                .collect(),
        )
    }
}
