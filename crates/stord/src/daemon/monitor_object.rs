//! The `monitor-qmp` object as the daemon holds it (QEMU 11.1's MonitorQMPProperties),
//! and the contract with the QMP layer that opens the monitor itself: [`OpenMonitor`]
//! opens one, [`RuntimeMonitor`] is what it returns. The operations are in
//! [`super::monitors`].

use std::io;
use std::os::fd::OwnedFd;
use std::rc::Rc;

use crate::chardev::Chardev;

/// A `monitor-qmp` object's properties.
#[derive(Debug, Clone)]
pub struct MonitorSettings {
    /// The object's id.
    pub id: String,
    /// The chardev it talks through.
    pub chardev: String,
    /// Replies and events pretty-printed (QEMU's JSON writer's pretty form).
    pub pretty: bool,
    /// `close-action=delete`: gone with its chardev once its client hangs up.
    pub close_delete: bool,
    /// The chardev's log (`logfile`): what the monitor sends goes there too.
    pub log: Option<crate::chardev::log::SharedLog>,
}

/// A monitor made at run time, as the daemon holds it.
pub trait RuntimeMonitor {
    /// Stops accepting and disconnects its clients (the chardev stays).
    fn stop(self: Box<Self>);
}

/// Opens a monitor on a chardev (given the duplicate of its socket when the chardev is
/// open already): the QMP layer's, installed by the process.
pub type OpenMonitor =
    Rc<dyn Fn(&Chardev, Option<OwnedFd>, &MonitorSettings) -> io::Result<Box<dyn RuntimeMonitor>>>;

/// One `monitor-qmp` object.
pub(super) struct MonitorObject {
    pub(super) settings: MonitorSettings,
    pub(super) handle: Box<dyn RuntimeMonitor>,
}
