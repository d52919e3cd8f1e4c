//! The backend-request channel (`VHOST_USER_PROTOCOL_F_BACKEND_REQ`): the socket on which
//! the device speaks first, used here only to say the config space changed when the node
//! was resized (`CONFIG_CHANGE_MSG`, as QEMU's vu_blk_exp_resize). The connection's control
//! thread sets it up; the export's resize tells the frontend through it.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use vhost::vhost_user::message::BackendReq;

use crate::export::virtio_blk::device::BlkDevice;

/// A vhost-user header with no body: the request code, the flags (protocol version 1, no
/// reply asked: a frontend answers only when NEED_REPLY is set), the body's size 0.
fn config_change_message() -> [u8; 12] {
    let code: u32 = BackendReq::CONFIG_CHANGE_MSG.into();
    let mut m = [0u8; 12];
    m[0..4].copy_from_slice(&code.to_le_bytes());
    m[4..8].copy_from_slice(&1u32.to_le_bytes());
    m
}

/// The connected frontend's channel, if it set one up.
#[derive(Default)]
pub struct ConfigChannel(Mutex<Option<Open>>);

/// The channel, and the capacity the frontend last heard of.
struct Open {
    sock: UnixStream,
    sectors: u64,
}

impl ConfigChannel {
    /// The frontend connected gave its backend-request channel (`SET_BACKEND_REQ_FD`), or
    /// the connection ended (`None`).
    pub fn set(&self, dev: &BlkDevice, sock: Option<UnixStream>) {
        let channel = sock.and_then(|sock| {
            // Never let a frontend that does not read its channel block the main loop.
            sock.set_nonblocking(true).ok()?;
            Some(Open {
                sock,
                sectors: dev.sectors(),
            })
        });
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = channel;
    }

    /// The node may have changed size. If the capacity differs from what the frontend
    /// last read, tells it the config space changed (`CONFIG_CHANGE_MSG`, as QEMU's
    /// vu_blk_exp_resize does), so it reads the config again and tells its guest. Returns
    /// whether a message went out. Frontends without the channel (libblkio) read the
    /// config space anew when asked, and it follows the node.
    pub fn announce_capacity(&self, dev: &BlkDevice) -> bool {
        let mut channel = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = channel.as_mut() else {
            return false;
        };
        let sectors = dev.sectors();
        if sectors == c.sectors {
            return false;
        }
        match (&c.sock).write(&config_change_message()) {
            Ok(12) => {
                c.sectors = sectors;
                true
            }
            r => {
                tracing::warn!(
                    "vhost-user-blk {}: cannot tell the frontend of the new capacity ({r:?}); \
                     it sees the old size until it reads the config space again",
                    dev.id
                );
                *channel = None;
                false
            }
        }
    }
}
