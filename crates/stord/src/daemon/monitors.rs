//! QMP monitors made and removed at run time: QEMU 11.1's `monitor-qmp` objects
//! (`object-add qom-type=monitor-qmp,id=ID,chardev=CHR[,pretty=on][,close-action=delete]`
//! and `object-del`, or `--object`). The monitor itself is the QMP layer's: it installs
//! the function that opens one ([`OpenMonitor`]) when the process starts, and the daemon
//! holds what it returns. As QEMU's: the chardev must exist and have no other user;
//! `object-del` stops the monitor (its clients disconnected) and leaves the chardev, free
//! for `chardev-remove` or another monitor; a client cannot delete the monitor it is
//! talking through; with `close-action=delete` the monitor and its chardev go when its
//! client hangs up.

use serde_json::Value;

use super::error::DaemonError;
use super::monitor_object::{MonitorObject, MonitorSettings, OpenMonitor};
use super::state::State;
use crate::cli::keyval::KeyVal;

impl State {
    /// The QMP layer's monitor opener (the process installs it at start).
    pub fn set_monitor_opener(&mut self, f: OpenMonitor) {
        self.monitor_opener = Some(f);
    }

    /// The monitor whose client's command runs now (None: a command-line monitor).
    pub fn set_current_monitor(&mut self, id: Option<String>) {
        self.current_monitor = id;
    }

    /// `monitor-qmp`'s properties: `chardev` (required), `pretty`, `close-action`.
    pub(super) fn create_monitor(&mut self, id: &str, mut kv: KeyVal) -> Result<(), DaemonError> {
        let chardev = kv.take_required("chardev")?;
        let chardev_id = chardev.clone();
        let pretty = kv.take_bool("pretty", false)?;
        let close = kv.take_choice("close-action", &["none", "delete"])?;
        kv.finish()?;
        let settings = MonitorSettings {
            id: id.to_string(),
            chardev,
            pretty,
            close_delete: close.as_deref() == Some("delete"),
            log: self.chardevs.log_of(&chardev_id),
        };
        let Some(open) = self.monitor_opener.clone() else {
            return Err(DaemonError::Invalid("monitors cannot be made here".into()));
        };
        let (dev, fd) = self
            .chardevs
            .attach_monitor(&settings.chardev)
            .map_err(|e| DaemonError::Invalid(e.to_string()))?;
        match open(&dev, fd, &settings) {
            Ok(handle) => {
                let m = MonitorObject { settings, handle };
                self.monitors.insert(id.to_string(), m);
                Ok(())
            }
            Err(e) => {
                self.chardevs.detach_monitor(&settings.chardev);
                Err(DaemonError::Invalid(e.to_string()))
            }
        }
    }

    /// `object-del` of a monitor: refused for the monitor the command came through.
    pub(super) fn delete_monitor(&mut self, id: &str) -> Result<(), DaemonError> {
        if self.current_monitor.as_deref() == Some(id) {
            return Err(DaemonError::Invalid(format!(
                "Monitor '{id}' cannot be deleted by a command it is running"
            )));
        }
        self.remove_monitor(id);
        Ok(())
    }

    /// Stops monitor `id` and frees its chardev; its chardev id.
    fn remove_monitor(&mut self, id: &str) -> Option<String> {
        let m = self.monitors.remove(id)?;
        m.handle.stop();
        self.chardevs.detach_monitor(&m.settings.chardev);
        Some(m.settings.chardev)
    }

    /// A client of monitor `id` hung up: with `close-action=delete` the monitor goes, and
    /// its chardev with it.
    pub fn monitor_closed(&mut self, id: &str) {
        if !self
            .monitors
            .get(id)
            .is_some_and(|m| m.settings.close_delete)
        {
            return;
        }
        if let Some(chardev) = self.remove_monitor(id) {
            if let Err(e) = self.chardevs.remove(&chardev) {
                tracing::warn!("monitor '{id}': its chardev stays: {e}");
            }
        }
    }

    /// A monitor's properties as qom-get reads them.
    pub fn monitor_properties(&self, id: &str) -> Option<Vec<(&'static str, Value)>> {
        let s = &self.monitors.get(id)?.settings;
        let close = if s.close_delete { "delete" } else { "none" };
        Some(vec![
            ("chardev", s.chardev.clone().into()),
            ("pretty", s.pretty.into()),
            ("close-action", close.into()),
        ])
    }
}
