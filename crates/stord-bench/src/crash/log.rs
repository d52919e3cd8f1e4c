//! Reading a dm-log-writes log (as Linux's dm-log-writes, QEMU's blklogwrites and stord's
//! write it) and replaying its entries onto a copy of the device it logged. Written apart
//! from stord's writer on purpose: the reader checks the writer, and reads qsd's logs too.
//!
//! Layout, little-endian: the superblock in sector 0 (magic, version 1, entry count,
//! sector size); from sector 1, each entry is a header sector (sector, sector count,
//! flags, data length) followed by its data, but for a discard, which carries none.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

const MAGIC: u64 = 0x006a_7366_7773_6872;
pub const FLUSH: u64 = 1;
pub const DISCARD: u64 = 4;
const KNOWN_FLAGS: u64 = 0xf;

/// One entry of the log.
#[derive(Clone, Copy, Debug)]
pub struct LogEntry {
    /// Where it was written on the device, in log sectors.
    pub sector: u64,
    pub nr_sectors: u64,
    pub flags: u64,
    /// Where its data begins in the log, in bytes.
    pub data_at: u64,
}

impl LogEntry {
    pub fn is_flush(&self) -> bool {
        self.flags & FLUSH != 0
    }
    pub fn is_discard(&self) -> bool {
        self.flags & DISCARD != 0
    }
}

/// A log, read whole.
pub struct Log {
    pub sector_size: u64,
    pub entries: Vec<LogEntry>,
    file: File,
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn bad(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, m)
}

/// The entry count in the superblock of the log at `path`, as it stands now.
pub fn count(path: &Path) -> io::Result<u64> {
    let mut sb = [0u8; 24];
    File::open(path)?.read_exact_at(&mut sb, 0)?;
    Ok(le64(&sb, 16))
}

impl Log {
    /// Reads the log at `path`: the entries its superblock counts.
    pub fn open(path: &Path) -> io::Result<Log> {
        let file = File::open(path)?;
        let mut sb = [0u8; 28];
        file.read_exact_at(&mut sb, 0)?;
        if le64(&sb, 0) != MAGIC {
            return Err(bad(format!("{}: not a dm-log-writes log", path.display())));
        }
        if le64(&sb, 8) != 1 {
            return Err(bad(format!("log version {}", le64(&sb, 8))));
        }
        let count = le64(&sb, 16);
        let sector_size = u64::from(u32::from_le_bytes(sb[24..28].try_into().unwrap()));
        if !sector_size.is_power_of_two() || sector_size < 32 {
            return Err(bad(format!("log sector size {sector_size}")));
        }
        let len = file.metadata()?.len();
        let mut entries = Vec::with_capacity(count as usize);
        let mut at = sector_size;
        for i in 0..count {
            let mut h = [0u8; 32];
            if at + sector_size > len {
                return Err(bad(format!("entry {i} lies past the log's end")));
            }
            file.read_exact_at(&mut h, at)?;
            let e = LogEntry {
                sector: le64(&h, 0),
                nr_sectors: le64(&h, 8),
                flags: le64(&h, 16),
                data_at: at + sector_size,
            };
            if e.flags & !KNOWN_FLAGS != 0 {
                return Err(bad(format!("entry {i}: flags {:#x}", e.flags)));
            }
            at += sector_size * if e.is_discard() { 1 } else { 1 + e.nr_sectors };
            if at > len {
                return Err(bad(format!("entry {i}'s data lies past the log's end")));
            }
            entries.push(e);
        }
        Ok(Log {
            sector_size,
            entries,
            file,
        })
    }

    /// The indices of the flush entries.
    pub fn flushes(&self) -> Vec<usize> {
        (0..self.entries.len())
            .filter(|&i| self.entries[i].is_flush())
            .collect()
    }

    /// Replays entry `i` onto `dev`: its data written (a discard: its sectors zeroed), or
    /// of its sectors only those `keep` keeps (a torn write).
    pub fn replay(&self, i: usize, dev: &File, keep: &dyn Fn(u64) -> bool) -> io::Result<()> {
        let e = self.entries[i];
        if e.is_flush() || e.nr_sectors == 0 {
            return Ok(());
        }
        let ss = self.sector_size;
        let mut data = vec![0u8; (e.nr_sectors * ss) as usize];
        if !e.is_discard() {
            self.file.read_exact_at(&mut data, e.data_at)?;
        }
        // Runs of kept sectors, one write each.
        let mut s = 0;
        while s < e.nr_sectors {
            if !keep(s) {
                s += 1;
                continue;
            }
            let run = (s..e.nr_sectors).take_while(|&t| keep(t)).count() as u64;
            let bytes = &data[(s * ss) as usize..((s + run) * ss) as usize];
            dev.write_all_at(bytes, (e.sector + s) * ss)?;
            s += run;
        }
        Ok(())
    }
}

/// `stord-bench replay LOG DEVICE [--entries N]`: replays the first N entries of LOG (all
/// it counts by default) onto DEVICE in place, a copy of the device as logging began.
pub fn replay_command(args: &[String]) -> io::Result<()> {
    let (log, dev, n) = match args {
        [l, d] => (l, d, None),
        [l, d, f, n] if f == "--entries" => (l, d, Some(n.parse().map_err(io::Error::other)?)),
        _ => {
            return Err(io::Error::other(
                "usage: stord-bench replay LOG DEVICE [--entries N]",
            ))
        }
    };
    let log = Log::open(Path::new(log))?;
    let dev = std::fs::OpenOptions::new().write(true).open(dev)?;
    let n = n.unwrap_or(log.entries.len()).min(log.entries.len());
    for i in 0..n {
        log.replay(i, &dev, &|_| true)?;
    }
    println!(
        "replayed {n} of {} entries ({} flushes among them)",
        log.entries.len(),
        log.entries[..n].iter().filter(|e| e.is_flush()).count()
    );
    Ok(())
}
