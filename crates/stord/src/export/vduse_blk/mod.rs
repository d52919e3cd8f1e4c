//! The vduse-blk export: a node as a virtio-blk device of the host kernel itself (VDUSE),
//! which `vdpa dev add ... mgmtdev vduse` turns into a /dev/vdX for containers and
//! processes, no virtual machine involved.
//!
//! The device is created through /dev/vduse/control. A control thread reads the kernel's
//! messages from /dev/vduse/<name> (they are rare and may wait for queues to drain, as
//! vhost-user's control messages do): SET_STATUS starts the queues at DRIVER_OK and stops
//! them at reset, GET_VQ_STATE answers the next avail index, UPDATE_IOTLB unmaps what the
//! kernel took back. The queues run on IoThreads with the same device, ring and request
//! code as vhost-user-blk ([`virtio_blk`](super::virtio_blk)): a kick eventfd the kernel
//! signals, the avail index as a poll handler; interrupts are an ioctl. Their memory is
//! the driver's IOVA space, mapped range by range as chains point into it ([`memory`]).
//! As qsd, a device that already exists is taken over (a restarted daemon reconnects),
//! and one still attached to the vDPA bus when the export goes stays for the next.

mod control;
mod memory;
mod uapi;

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use stord_aio::Remote;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_F_CONFIG_WCE, VIRTIO_BLK_F_MQ};

use super::virtio_blk::device::BlkDevice;
use super::virtio_blk::export::{queue_remotes, Transport, VirtioBlkExport};
use super::virtio_blk::inflight::InflightRegion;
use crate::cli::keyval::KeyVal;
use crate::export::{Export, ExportEnv, ExportError};
use control::Controller;

/// VIRTIO_F_ACCESS_PLATFORM: the kernel refuses a VDUSE device without it.
const VIRTIO_F_ACCESS_PLATFORM: u32 = 33;
/// The size of `struct virtio_blk_config` QEMU hands the kernel.
const CONFIG_SIZE: u32 = 96;

/// Options of `--export type=vduse-blk`.
pub struct VduseBlkOptions {
    pub id: String,
    pub node_name: String,
    /// The VDUSE device name (/dev/vduse/<name>, `vdpa dev add name <name>`).
    pub name: String,
    pub writable: bool,
    pub writethrough: bool,
    pub num_queues: u16,
    pub queue_size: u16,
    pub logical_block_size: u32,
    pub serial: String,
    pub iothreads: Vec<String>,
}

impl VduseBlkOptions {
    /// Parses the options after `type=vduse-blk`, with QEMU's checks and texts.
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, ExportError> {
        let id = kv.take_required("id")?;
        let node_name = kv.take_required("node-name")?;
        let name = kv
            .take("name")
            .ok_or_else(|| "Parameter 'name' is missing".to_string())?;
        let writable = kv.take_bool("writable", false)?;
        let writethrough = kv.take_bool("writethrough", false)?;
        let _ = kv.take_bool("fixed-iothread", false)?;
        let num_queues = kv.take_u64_in("num-queues", false, 0..=u64::from(u16::MAX))?;
        let num_queues = match num_queues {
            None => 1,
            Some(0) => return Err("num-queues must be greater than 0".to_string().into()),
            Some(n) => n as u16,
        };
        let queue_size = match kv.take_u64_in("queue-size", false, 0..=u64::from(u16::MAX))? {
            None => 256,
            Some(n) if n > 2 && n <= 1024 && n.is_power_of_two() => n as u16,
            Some(_) => return Err("queue-size is invalid".to_string().into()),
        };
        let logical_block_size = match kv.take_u64("logical-block-size", true)? {
            None => 512,
            Some(n) if (512..=2 << 20).contains(&n) && n.is_power_of_two() => n as u32,
            Some(_) => {
                return Err(
                    "parameter logical-block-size must be a power of 2 between 512 \
                            and 2097152"
                        .to_string()
                        .into(),
                )
            }
        };
        let serial = kv.take("serial").unwrap_or_default();
        let iothreads = kv.take_list("iothread");
        Ok(Self {
            id,
            node_name,
            name,
            writable,
            writethrough,
            num_queues,
            queue_size,
            logical_block_size,
            serial,
            iothreads,
        })
    }
}

/// `--export type=vduse-blk` / `block-export-add`.
pub fn create(env: &ExportEnv<'_>, mut kv: KeyVal) -> Result<Box<dyn Export>, ExportError> {
    let opts = VduseBlkOptions::from_opts(&mut kv)?;
    let what = kv.what.clone();
    kv.finish()?;
    let node = env.node(&what, &opts.node_name)?;
    if opts.writable && node.is_read_only() {
        return Err("Cannot export read-only node as writable"
            .to_string()
            .into());
    }
    env.check_claim(&what, &format!("vduse:{}", opts.name))?;
    let remotes = queue_remotes(&what, env.remotes(&what, &opts.iothreads)?)?;
    let mut dev = BlkDevice::new(
        opts.id.clone(),
        node,
        opts.writable,
        opts.logical_block_size,
        opts.num_queues,
    );
    dev.kind = "vduse-blk";
    dev.serial = opts.serial.clone();
    dev.writeback.store(!opts.writethrough, Ordering::Relaxed);
    let dev = Arc::new(dev);
    // QMP gets qsd's text; the cause goes to the log, as libvduse prints it.
    let export = VduseBlkExport::start(opts, dev, remotes).map_err(|e| {
        tracing::error!("{what}: vduse-blk: {e}");
        "failed to create vduse device".to_string()
    })?;
    Ok(Box::new(export))
}

/// A vduse-blk export: the virtio-blk device served to the host kernel through VDUSE.
pub type VduseBlkExport = VirtioBlkExport<VduseDevice>;

/// The VDUSE transport of an export: the kernel's device and the control thread that
/// answers it.
pub struct VduseDevice {
    name: String,
    /// Taken at close: it must be closed before the device can be destroyed.
    device: Option<Arc<uapi::Device>>,
    control: uapi::Control,
    /// Written to stop the control thread.
    stop: File,
    thread: Option<JoinHandle<()>>,
}

/// The virtio feature bits the device offers: the device's, less what VDUSE refuses (a
/// writable cache switch) or has no use for, plus ACCESS_PLATFORM, which it requires.
fn features(dev: &BlkDevice) -> u64 {
    let mut f = dev.features() & !(1 << VIRTIO_BLK_F_CONFIG_WCE);
    if dev.num_queues == 1 {
        f &= !(1 << VIRTIO_BLK_F_MQ);
    }
    f | (1 << VIRTIO_F_ACCESS_PLATFORM)
}

impl VduseBlkExport {
    fn start(
        opts: VduseBlkOptions,
        dev: Arc<BlkDevice>,
        remotes: Vec<Remote>,
    ) -> Result<Self, String> {
        let control = uapi::Control::open().map_err(|e| format!("/dev/vduse/control: {e}"))?;
        let config = dev.config(0, CONFIG_SIZE, opts.queue_size);
        let header = uapi::dev_config(&opts.name, features(&dev), u32::from(opts.num_queues))
            .map_err(|_| format!("invalid device name '{}'", opts.name))?;
        let fresh = match control.create(header, &config) {
            Ok(()) => true,
            // A device left by an earlier daemon: taken over as it is (as qsd does).
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
            Err(e) => return Err(e.to_string()),
        };
        let started = Self::serve_device(&opts, &dev, &remotes, fresh);
        let (device, stop, thread) = match started {
            Ok(s) => s,
            Err(e) => {
                // A device made here goes again (the next attempt would take it over).
                if fresh {
                    let _ = control.destroy(&opts.name);
                }
                return Err(e);
            }
        };
        let transport = VduseDevice {
            name: opts.name,
            device: Some(device),
            control,
            stop,
            thread: Some(thread),
        };
        Ok(VirtioBlkExport::new(dev, remotes, transport))
    }

    /// Opens the device and starts its control thread: the device, the thread's stop
    /// eventfd and the thread.
    fn serve_device(
        opts: &VduseBlkOptions,
        dev: &Arc<BlkDevice>,
        remotes: &[Remote],
        fresh: bool,
    ) -> Result<(Arc<uapi::Device>, File, JoinHandle<()>), String> {
        // Which requests are in flight, kept where the next daemon finds them.
        let log = log_path(&opts.name);
        let inflight = InflightRegion::in_file(&log, opts.num_queues, opts.queue_size, fresh)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let device =
            uapi::Device::open(&opts.name).map_err(|e| format!("/dev/vduse/{}: {e}", opts.name))?;
        for i in 0..u32::from(opts.num_queues) {
            match device.vq_setup(i, opts.queue_size) {
                Ok(()) => {}
                // A device taken over keeps what it was made with.
                Err(_) if !fresh => {}
                Err(e) => return Err(format!("queue {i}: {e}")),
            }
        }
        if !fresh {
            // The node's size now, if it changed while nobody served the device.
            let _ = device.set_config(0, &dev.sectors().to_le_bytes());
        }
        let device = Arc::new(device);
        let stop = File::from(stord_aio::sys::eventfd().map_err(|e| e.to_string())?);
        let stop_rx = stop.try_clone().map_err(|e| e.to_string())?;
        dev.serving.fetch_add(1, Ordering::SeqCst);
        let mut c = Controller::new(
            dev.clone(),
            device.clone(),
            remotes.to_vec(),
            opts.queue_size,
            Arc::new(inflight),
        );
        let d = dev.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vduse-{}", opts.id))
            .spawn(move || {
                // A device taken over may be running already.
                c.take_over();
                c.serve(&stop_rx);
                c.stop_queues();
                d.serving.fetch_sub(1, Ordering::SeqCst);
                d.drain.wake();
            });
        match thread {
            Ok(t) => Ok((device, stop, t)),
            Err(e) => {
                dev.serving.fetch_sub(1, Ordering::SeqCst);
                Err(format!("cannot start a control thread: {e}"))
            }
        }
    }
}

impl Transport for VduseDevice {
    const KIND: &'static str = "vduse-blk";

    fn claim(&self) -> String {
        format!("vduse:{}", self.name)
    }

    fn in_use(&self) -> bool {
        false
    }

    fn halt(&mut self) {
        use std::io::Write;
        let _ = (&self.stop).write(&1u64.to_ne_bytes());
    }

    fn close(&mut self, dev: &Arc<BlkDevice>) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The device can only go once nothing has it open: our descriptor first. While it
        // is attached to the vDPA bus the kernel keeps it (EBUSY), for the next daemon to
        // take over, as qsd leaves it.
        drop(self.device.take());
        match self.control.destroy(&self.name) {
            Ok(()) => {
                let _ = std::fs::remove_file(log_path(&self.name));
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => tracing::info!(
                "vduse-blk {}: device {} is still attached; it stays until `vdpa dev del`",
                dev.id,
                self.name
            ),
            Err(e) => tracing::warn!("vduse-blk {}: cannot destroy {}: {e}", dev.id, self.name),
        }
    }

    /// The new capacity goes into the config space, with a config interrupt (as QEMU's
    /// vduse_blk_resize).
    fn resized(&self, dev: &BlkDevice) {
        let sectors = dev.sectors();
        let Some(device) = &self.device else { return };
        // Before DRIVER_OK there is nobody to interrupt (EINVAL): the driver reads the
        // config when it starts.
        let told =
            device
                .set_config(0, &sectors.to_le_bytes())
                .and_then(|()| match device.config_irq() {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
                    r => r,
                });
        if let Err(e) = told {
            tracing::warn!(
                "vduse-blk {}: cannot tell the driver of the new size: {e}",
                dev.id
            );
        }
    }
}

/// Where device `name`'s in-flight log lives (qsd keeps its own, in another format, at
/// $TMPDIR/vduse-blk-<name>).
fn log_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("stord-vduse-{name}"))
}
