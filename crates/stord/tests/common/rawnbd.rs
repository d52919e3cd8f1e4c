//! A deliberately small, blocking NBD client for protocol edge cases that real clients
//! refuse to send (out-of-range requests, unknown commands, garbage, abrupt disconnects).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;

pub struct RawNbd {
    pub s: UnixStream,
    pub size: u64,
    pub flags: u16,
}

/// One structured reply chunk: (flags, type, handle, payload).
pub type Chunk = (u16, u16, u64, Vec<u8>);

/// Opens a connection, checks the server's greeting and sends the client flags.
pub fn hello(sock: &Path, client_flags: u32) -> UnixStream {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"NBDMAGIC");
    assert_eq!(&hello[8..16], b"IHAVEOPT");
    s.write_all(&client_flags.to_be_bytes()).unwrap();
    s
}

/// Sends option `opt` with `data`.
pub fn send_option(s: &mut UnixStream, opt: u32, data: &[u8]) {
    send_option_header(s, opt, data.len() as u32);
    s.write_all(data).unwrap();
}

/// Sends only an option's header (a length with no data behind it yet).
pub fn send_option_header(s: &mut UnixStream, opt: u32, len: u32) {
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(b"IHAVEOPT");
    h.extend_from_slice(&opt.to_be_bytes());
    h.extend_from_slice(&len.to_be_bytes());
    s.write_all(&h).unwrap();
}

/// Reads one option reply: (option, reply type, data).
pub fn read_option_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(
        u64::from_be_bytes(h[..8].try_into().unwrap()),
        0x0003_e889_0455_65a9,
        "option reply magic"
    );
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
    let mut d = vec![0u8; len];
    s.read_exact(&mut d).unwrap();
    (opt, kind, d)
}

/// True if the server closes `s` without sending anything more (within 5 s).
pub fn closed_silently(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// The payload of an INFO/GO option asking for export `name` with no info requests.
pub fn go_data(name: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name);
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

impl RawNbd {
    /// Connects with structured replies negotiated, then OPT_GO.
    pub fn connect_structured(sock: &Path, name: &str) -> RawNbd {
        let mut s = hello(sock, 3);
        send_option(&mut s, 8, &[]); // STRUCTURED_REPLY
        let (_, kind, _) = read_option_reply(&mut s);
        assert_eq!(kind, 1, "STRUCTURED_REPLY refused");
        Self::go(s, name)
    }

    /// Reads one structured reply chunk.
    pub fn read_chunk(&mut self) -> Chunk {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            0x668e_33ef,
            "structured reply magic"
        );
        let flags = u16::from_be_bytes([h[4], h[5]]);
        let kind = u16::from_be_bytes([h[6], h[7]]);
        let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        self.s.read_exact(&mut d).unwrap();
        (flags, kind, handle, d)
    }

    /// Connects and negotiates export `name` with OPT_GO (simple replies only).
    pub fn connect(sock: &Path, name: &str) -> RawNbd {
        let mut s = UnixStream::connect(sock).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..8], b"NBDMAGIC");
        assert_eq!(&hello[8..16], b"IHAVEOPT");
        s.write_all(&3u32.to_be_bytes()).unwrap(); // FIXED_NEWSTYLE | NO_ZEROES
        Self::go(s, name)
    }

    /// Sends OPT_GO for `name` and reads its replies.
    fn go(mut s: UnixStream, name: &str) -> RawNbd {
        let mut data = Vec::new();
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut opt = Vec::new();
        opt.extend_from_slice(b"IHAVEOPT");
        opt.extend_from_slice(&7u32.to_be_bytes()); // GO
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(&data);
        s.write_all(&opt).unwrap();
        let (mut size, mut flags) = (0, 0);
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h).unwrap();
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut d = vec![0u8; len];
            s.read_exact(&mut d).unwrap();
            match kind {
                1 => break, // ACK
                3 if u16::from_be_bytes([d[0], d[1]]) == 0 => {
                    size = u64::from_be_bytes(d[2..10].try_into().unwrap());
                    flags = u16::from_be_bytes([d[10], d[11]]);
                }
                3 => {}
                k => panic!(
                    "GO failed: reply type {k:#x}: {}",
                    String::from_utf8_lossy(&d)
                ),
            }
        }
        RawNbd { s, size, flags }
    }

    pub fn send_request(
        &mut self,
        kind: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) {
        let mut r = Vec::with_capacity(28 + payload.len());
        r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        r.extend_from_slice(&flags.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&handle.to_be_bytes());
        r.extend_from_slice(&offset.to_be_bytes());
        r.extend_from_slice(&len.to_be_bytes());
        r.extend_from_slice(payload);
        self.s.write_all(&r).unwrap();
    }

    /// Reads a simple reply: (error, handle); for a successful read, `data_len` bytes follow.
    pub fn read_reply(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(
            u32::from_be_bytes(h[0..4].try_into().unwrap()),
            0x6744_6698,
            "simple reply magic"
        );
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let mut data = vec![0u8; if err == 0 { data_len } else { 0 }];
        self.s.read_exact(&mut data).unwrap();
        (err, handle, data)
    }

    pub fn write(&mut self, handle: u64, offset: u64, data: &[u8]) -> u32 {
        self.send_request(CMD_WRITE, 0, handle, offset, data.len() as u32, data);
        self.read_reply(0).0
    }

    pub fn read(&mut self, handle: u64, offset: u64, len: u32) -> (u32, Vec<u8>) {
        self.send_request(CMD_READ, 0, handle, offset, len, &[]);
        let (e, _, d) = self.read_reply(len as usize);
        (e, d)
    }

    /// True if the server has closed the connection (EOF within the timeout).
    pub fn is_closed(&mut self) -> bool {
        self.s
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 64];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}
