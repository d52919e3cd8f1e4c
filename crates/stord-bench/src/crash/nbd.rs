//! A blocking NBD client of one request at a time, over a Unix socket: the workloads'
//! guest, which must know exactly which of its writes were acknowledged before which flush.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const READ: u16 = 0;
const WRITE: u16 = 1;
const DISC: u16 = 2;
const FLUSH: u16 = 3;
const TRIM: u16 = 4;
const WRITE_ZEROES: u16 = 6;

pub struct Nbd {
    s: UnixStream,
    pub size: u64,
    handle: u64,
}

impl Nbd {
    /// Connects and opens export `name` (fixed newstyle, OPT_GO, simple replies).
    pub fn connect(sock: &Path, name: &str) -> io::Result<Nbd> {
        let mut s = UnixStream::connect(sock)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello)?;
        if &hello[..16] != b"NBDMAGICIHAVEOPT" {
            return Err(io::Error::other("not an NBD server"));
        }
        s.write_all(&3u32.to_be_bytes())?; // FIXED_NEWSTYLE | NO_ZEROES
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut opt = b"IHAVEOPT".to_vec();
        opt.extend_from_slice(&7u32.to_be_bytes()); // GO
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(&data);
        s.write_all(&opt)?;
        let mut size = 0;
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h)?;
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let mut d = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
            s.read_exact(&mut d)?;
            match kind {
                1 => break,
                3 if d.len() >= 12 && d[..2] == [0, 0] => {
                    size = u64::from_be_bytes(d[2..10].try_into().unwrap());
                }
                3 => {}
                k => return Err(io::Error::other(format!("NBD_OPT_GO: reply {k:#x}"))),
            }
        }
        Ok(Nbd { s, size, handle: 0 })
    }

    /// One request and its reply; the reply's data for a read.
    fn request(&mut self, kind: u16, offset: u64, len: u32, data: &[u8]) -> io::Result<Vec<u8>> {
        self.handle += 1;
        let mut r = Vec::with_capacity(28 + data.len());
        r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        r.extend_from_slice(&0u16.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&self.handle.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        r.extend_from_slice(data);
        self.s.write_all(&r)?;
        if kind == DISC {
            return Ok(Vec::new());
        }
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        if h[..4] != 0x6744_6698u32.to_be_bytes() || h[8..16] != self.handle.to_be_bytes() {
            return Err(io::Error::other("bad NBD reply"));
        }
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        if err != 0 {
            return Err(io::Error::other(format!("NBD error {err}")));
        }
        let mut out = vec![0u8; if kind == READ { len as usize } else { 0 }];
        self.s.read_exact(&mut out)?;
        Ok(out)
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.request(WRITE, offset, data.len() as u32, data)
            .map(drop)
    }
    pub fn write_zeroes(&mut self, offset: u64, len: u32) -> io::Result<()> {
        self.request(WRITE_ZEROES, offset, len, &[]).map(drop)
    }
    pub fn trim(&mut self, offset: u64, len: u32) -> io::Result<()> {
        self.request(TRIM, offset, len, &[]).map(drop)
    }
    pub fn flush(&mut self) -> io::Result<()> {
        self.request(FLUSH, 0, 0, &[]).map(drop)
    }
    pub fn read(&mut self, offset: u64, len: u32) -> io::Result<Vec<u8>> {
        self.request(READ, offset, len, &[])
    }
    pub fn disconnect(mut self) {
        let _ = self.request(DISC, 0, 0, &[]);
    }
}
