//! The kernel's VDUSE interface (include/uapi/linux/vduse.h): the structures, the ioctls on
//! /dev/vduse/control and /dev/vduse/<name>, and the control messages read from and
//! written to the device. Every `unsafe` of the VDUSE export is here.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const VDUSE_BASE: u64 = 0x81;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

/// `_IOC(dir, type, nr, size)`.
const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (VDUSE_BASE << 8) | nr
}

/// The API version we speak (0: the original one, which 6.x kernels all take).
pub const API_VERSION: u64 = 0;
pub const NAME_MAX: usize = 256;

/// `struct vduse_dev_config` without its trailing config space.
#[repr(C)]
pub struct DevConfig {
    pub name: [u8; NAME_MAX],
    pub vendor_id: u32,
    pub device_id: u32,
    pub features: u64,
    pub vq_num: u32,
    pub vq_align: u32,
    pub reserved: [u32; 13],
    pub config_size: u32,
}

/// `struct vduse_iotlb_entry`.
#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct IotlbEntry {
    pub offset: u64,
    pub start: u64,
    pub last: u64,
    pub perm: u8,
}
pub const ACCESS_RO: u8 = 1;
pub const ACCESS_WO: u8 = 2;

/// `struct vduse_vq_config`.
#[repr(C)]
#[derive(Default)]
struct VqConfig {
    index: u32,
    max_size: u16,
    reserved: [u16; 13],
}

/// `struct vduse_vq_info` (split rings: the union's first u16 is the avail index).
#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct VqInfo {
    pub index: u32,
    pub num: u32,
    pub desc_addr: u64,
    pub driver_addr: u64,
    pub device_addr: u64,
    pub avail_index: u16,
    _packed_rest: [u16; 3],
    pub ready: u8,
}

/// `struct vduse_vq_eventfd`.
#[repr(C)]
struct VqEventfd {
    index: u32,
    fd: i32,
}

/// `struct vduse_config_data` with room for a virtio-blk config space.
#[repr(C)]
struct ConfigData {
    offset: u32,
    length: u32,
    buffer: [u8; 256],
}

const SET_API_VERSION: u64 = ioc(IOC_WRITE, 0x01, 8);
const CREATE_DEV: u64 = ioc(IOC_WRITE, 0x02, std::mem::size_of::<DevConfig>());
const DESTROY_DEV: u64 = ioc(IOC_WRITE, 0x03, NAME_MAX);
const IOTLB_GET_FD: u64 = ioc(
    IOC_WRITE | IOC_READ,
    0x10,
    std::mem::size_of::<IotlbEntry>(),
);
const DEV_GET_FEATURES: u64 = ioc(IOC_READ, 0x11, 8);
const DEV_SET_CONFIG: u64 = ioc(IOC_WRITE, 0x12, 8);
const DEV_INJECT_CONFIG_IRQ: u64 = ioc(0, 0x13, 0);
const VQ_SETUP: u64 = ioc(IOC_WRITE, 0x14, std::mem::size_of::<VqConfig>());
const VQ_GET_INFO: u64 = ioc(IOC_WRITE | IOC_READ, 0x15, std::mem::size_of::<VqInfo>());
const VQ_SETUP_KICKFD: u64 = ioc(IOC_WRITE, 0x16, std::mem::size_of::<VqEventfd>());
const VQ_INJECT_IRQ: u64 = ioc(IOC_WRITE, 0x17, 4);

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// ioctl(2) with a pointer argument.
///
/// # Safety
/// `arg` must point at memory of the size and layout request `req` reads and writes.
unsafe fn ioctl_ptr<T>(fd: &File, req: u64, arg: *mut T) -> io::Result<libc::c_int> {
    // SAFETY: the caller vouches for `arg`; `fd` is an open descriptor.
    check(unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) })
}

fn name_bytes(name: &str) -> io::Result<[u8; NAME_MAX]> {
    let mut out = [0u8; NAME_MAX];
    if name.is_empty() || name.len() >= NAME_MAX || name.contains(['/', '\0']) {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    out[..name.len()].copy_from_slice(name.as_bytes());
    Ok(out)
}

/// /dev/vduse/control.
pub struct Control(File);

impl Control {
    pub fn open() -> io::Result<Control> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/vduse/control")?;
        let mut v = API_VERSION;
        // SAFETY: SET_API_VERSION reads one u64.
        unsafe { ioctl_ptr(&f, SET_API_VERSION, &mut v) }?;
        Ok(Control(f))
    }

    /// Creates device `name` with the config space `config`; EEXIST if it exists.
    pub fn create(&self, mut dev: DevConfig, config: &[u8]) -> io::Result<()> {
        dev.config_size = config.len() as u32;
        // The kernel reads the header and then config_size bytes right after it.
        let head = std::mem::size_of::<DevConfig>();
        let words = (head + config.len()).div_ceil(8);
        let mut buf = vec![0u64; words];
        // SAFETY: `buf` has room for the header and the config space after it; DevConfig
        // is plain data, copied byte for byte.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&dev as *const DevConfig).cast::<u8>(),
                buf.as_mut_ptr().cast::<u8>(),
                head,
            );
            std::ptr::copy_nonoverlapping(
                config.as_ptr(),
                buf.as_mut_ptr().cast::<u8>().add(head),
                config.len(),
            );
            ioctl_ptr(&self.0, CREATE_DEV, buf.as_mut_ptr())?;
        }
        Ok(())
    }

    /// Destroys device `name` (EBUSY while it is attached to a vDPA bus).
    pub fn destroy(&self, name: &str) -> io::Result<()> {
        let mut n = name_bytes(name)?;
        // SAFETY: DESTROY_DEV reads NAME_MAX bytes.
        unsafe { ioctl_ptr(&self.0, DESTROY_DEV, n.as_mut_ptr()) }?;
        Ok(())
    }
}

/// The device header for `name`: virtio-blk with `features`, `queues` queues.
pub fn dev_config(name: &str, features: u64, queues: u32) -> io::Result<DevConfig> {
    Ok(DevConfig {
        name: name_bytes(name)?,
        vendor_id: 0,
        device_id: 2, // VIRTIO_ID_BLOCK
        features,
        vq_num: queues,
        vq_align: 4096,
        reserved: [0; 13],
        config_size: 0,
    })
}

/// /dev/vduse/<name>: ioctls and the control messages.
pub struct Device(pub File);

impl Device {
    /// Opens the device non-blocking: a broken device reports POLLERR and would leave a
    /// blocking read waiting forever.
    pub fn open(name: &str) -> io::Result<Device> {
        use std::os::unix::fs::OpenOptionsExt;
        name_bytes(name)?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(format!("/dev/vduse/{name}"))?;
        Ok(Device(f))
    }

    /// The features the driver accepted.
    pub fn features(&self) -> io::Result<u64> {
        let mut f = 0u64;
        // SAFETY: DEV_GET_FEATURES writes one u64.
        unsafe { ioctl_ptr(&self.0, DEV_GET_FEATURES, &mut f) }?;
        Ok(f)
    }

    /// Sets queue `index`'s largest size.
    pub fn vq_setup(&self, index: u32, max_size: u16) -> io::Result<()> {
        let mut c = VqConfig {
            index,
            max_size,
            ..Default::default()
        };
        // SAFETY: VQ_SETUP reads a vduse_vq_config.
        unsafe { ioctl_ptr(&self.0, VQ_SETUP, &mut c) }?;
        Ok(())
    }

    pub fn vq_info(&self, index: u32) -> io::Result<VqInfo> {
        let mut i = VqInfo {
            index,
            ..Default::default()
        };
        // SAFETY: VQ_GET_INFO reads and writes a vduse_vq_info.
        unsafe { ioctl_ptr(&self.0, VQ_GET_INFO, &mut i) }?;
        Ok(i)
    }

    /// Has the kernel signal `eventfd` when the driver kicks queue `index`.
    pub fn vq_kickfd(&self, index: u32, eventfd: &File) -> io::Result<()> {
        let mut e = VqEventfd {
            index,
            fd: eventfd.as_raw_fd(),
        };
        // SAFETY: VQ_SETUP_KICKFD reads a vduse_vq_eventfd.
        unsafe { ioctl_ptr(&self.0, VQ_SETUP_KICKFD, &mut e) }?;
        Ok(())
    }

    /// Interrupts the driver for queue `index`.
    pub fn vq_irq(&self, index: u32) -> io::Result<()> {
        let mut i = index;
        // SAFETY: VQ_INJECT_IRQ reads a u32.
        unsafe { ioctl_ptr(&self.0, VQ_INJECT_IRQ, &mut i) }?;
        Ok(())
    }

    /// The mapping that covers `iova` (its range, permissions and file offset) and a
    /// descriptor of the memory behind it, to mmap.
    pub fn iotlb_fd(&self, iova: u64) -> io::Result<(IotlbEntry, File)> {
        let mut e = IotlbEntry {
            start: iova,
            last: iova,
            ..Default::default()
        };
        // SAFETY: IOTLB_GET_FD reads and writes a vduse_iotlb_entry and returns a new fd
        // that nothing else owns.
        let fd = unsafe { ioctl_ptr(&self.0, IOTLB_GET_FD, &mut e) }?;
        // SAFETY: see above.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // The kernel does not make it close-on-exec.
        // SAFETY: plain fcntl on the descriptor just made.
        check(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) })?;
        Ok((e, file))
    }

    /// Replaces `config` at `offset` of the config space.
    pub fn set_config(&self, offset: u32, config: &[u8]) -> io::Result<()> {
        let mut d = ConfigData {
            offset,
            length: config.len() as u32,
            buffer: [0; 256],
        };
        if config.len() > d.buffer.len() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        d.buffer[..config.len()].copy_from_slice(config);
        // SAFETY: DEV_SET_CONFIG reads the header and `length` bytes after it, all in `d`.
        unsafe { ioctl_ptr(&self.0, DEV_SET_CONFIG, &mut d) }?;
        Ok(())
    }

    /// Tells the driver the config space changed (EINVAL before DRIVER_OK).
    pub fn config_irq(&self) -> io::Result<()> {
        // SAFETY: DEV_INJECT_CONFIG_IRQ takes no argument.
        check(unsafe { libc::ioctl(self.0.as_raw_fd(), DEV_INJECT_CONFIG_IRQ as _, 0) })?;
        Ok(())
    }
}

/// What [`wait`] found.
pub struct Ready {
    /// The device has a message to read.
    pub message: bool,
    /// The device is broken (a reply came too late): it never sends anything again.
    pub broken: bool,
    /// The other descriptor is readable.
    pub other: bool,
}

/// Waits until `device` has a message or is broken, or `other` is readable.
pub fn wait(device: &Device, other: &impl AsRawFd) -> io::Result<Ready> {
    let (a, b) = poll2(&device.0, other)?;
    Ok(Ready {
        message: a & libc::POLLIN != 0,
        broken: a & (libc::POLLERR | libc::POLLHUP) != 0,
        other: b != 0,
    })
}

/// Waits until `fd` is readable; false if the wait was cut short.
pub fn wait_one(fd: &impl AsRawFd) -> io::Result<bool> {
    let (a, _) = poll2(fd, fd)?;
    Ok(a != 0)
}

/// Waits until `a` or `b` is readable (or hung up or failed); returns their revents.
fn poll2(a: &impl AsRawFd, b: &impl AsRawFd) -> io::Result<(i16, i16)> {
    let mut fds = [
        libc::pollfd {
            fd: a.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a live array of two pollfd.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r >= 0 {
            return Ok((fds[0].revents, fds[1].revents));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Request types read from the device.
pub const REQ_GET_VQ_STATE: u32 = 0;
pub const REQ_SET_STATUS: u32 = 1;
pub const REQ_UPDATE_IOTLB: u32 = 2;
pub const RESULT_OK: u32 = 0;
pub const RESULT_FAILED: u32 = 1;

/// `struct vduse_dev_request`, as bytes (152), with accessors.
pub struct Request(pub [u8; 152]);

impl Request {
    fn u32_at(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.0[at..at + 4].try_into().expect("4 bytes"))
    }
    fn u64_at(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.0[at..at + 8].try_into().expect("8 bytes"))
    }
    pub fn kind(&self) -> u32 {
        self.u32_at(0)
    }
    pub fn id(&self) -> u32 {
        self.u32_at(4)
    }
    /// GET_VQ_STATE: the queue asked about.
    pub fn vq_index(&self) -> u32 {
        self.u32_at(24)
    }
    /// SET_STATUS: the new device status.
    pub fn status(&self) -> u8 {
        self.0[24]
    }
    /// UPDATE_IOTLB: the IOVA range [start, last] whose mappings are gone.
    pub fn iova_range(&self) -> (u64, u64) {
        (self.u64_at(24), self.u64_at(32))
    }
}

/// `struct vduse_dev_response` (152 bytes): the answer to request `id`; for
/// GET_VQ_STATE, the queue's next avail index.
pub fn response(id: u32, ok: bool, vq: Option<(u32, u16)>) -> [u8; 152] {
    let mut r = [0u8; 152];
    r[0..4].copy_from_slice(&id.to_le_bytes());
    let result = if ok { RESULT_OK } else { RESULT_FAILED };
    r[4..8].copy_from_slice(&result.to_le_bytes());
    if let Some((index, avail)) = vq {
        r[24..28].copy_from_slice(&index.to_le_bytes());
        r[28..30].copy_from_slice(&avail.to_le_bytes());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_and_ioctl_numbers_match_the_kernel_header() {
        assert_eq!(std::mem::size_of::<DevConfig>(), 336);
        assert_eq!(std::mem::size_of::<IotlbEntry>(), 32);
        assert_eq!(std::mem::size_of::<VqConfig>(), 32);
        assert_eq!(std::mem::size_of::<VqInfo>(), 48);
        assert_eq!(std::mem::offset_of!(VqInfo, ready), 40);
        assert_eq!(std::mem::size_of::<VqEventfd>(), 8);
        // From linux/vduse.h as compiled by C.
        assert_eq!(CREATE_DEV, 0x4150_8102);
        assert_eq!(IOTLB_GET_FD, 0xc020_8110);
        assert_eq!(VQ_GET_INFO, 0xc030_8115);
        assert_eq!(VQ_INJECT_IRQ, 0x4004_8117);
        assert_eq!(DEV_INJECT_CONFIG_IRQ, 0x8113);
    }
}
