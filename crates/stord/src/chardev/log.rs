//! A chardev's log (QEMU's ChardevCommon: `logfile`, `logappend`, and QEMU 11.0's
//! `logtimestamp`): every byte the chardev sends is also written to the file, as QEMU's
//! qemu_chr_write_log writes it (what a monitor sends; not what ringbuf-write puts in a
//! ringbuf, which QEMU writes past the chardev layer). With `logtimestamp=on` each line of the log starts with the time it was
//! written, in UTC as QEMU's real_time_iso8601 gives it (GLib's ISO 8601 form:
//! `2026-02-01T17:36:33.413934Z`, the fraction left out when it is zero) and a space; one
//! write's lines share one time.

use std::cell::RefCell;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::cli::keyval::{KeyVal, OptionError};

/// What a chardev's options ask of its log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub file: Option<PathBuf>,
    pub append: bool,
    pub timestamp: bool,
}

impl LogOptions {
    /// `--chardev`'s `logfile`, `logappend`, `logtimestamp`.
    pub fn from_options(kv: &mut KeyVal) -> Result<Self, OptionError> {
        Ok(LogOptions {
            file: kv.take("logfile").map(PathBuf::from),
            append: kv.take_bool("logappend", false)?,
            timestamp: kv.take_bool("logtimestamp", false)?,
        })
    }

    /// A `chardev-add` backend's `data.logfile`, `data.logappend`, `data.logtimestamp`.
    pub fn from_qmp(backend: &Value) -> Self {
        let data = backend.get("data");
        let flag = |k: &str| data.and_then(|d| d.get(k)).and_then(Value::as_bool);
        LogOptions {
            file: data
                .and_then(|d| d.get("logfile"))
                .and_then(Value::as_str)
                .map(PathBuf::from),
            append: flag("logappend").unwrap_or(false),
            timestamp: flag("logtimestamp").unwrap_or(false),
        }
    }
}

/// An open log, shared by the chardev and the monitor that writes through it.
pub type SharedLog = Rc<RefCell<ChardevLog>>;

/// An open log file.
#[derive(Debug)]
pub struct ChardevLog {
    file: std::fs::File,
    timestamp: bool,
    /// The next byte starts a line (and so gets a time first).
    line_start: bool,
}

impl ChardevLog {
    /// Opens (creates, truncates unless appending) the log the options name, if any,
    /// with QEMU's words when it cannot.
    pub fn open(o: &LogOptions) -> Result<Option<SharedLog>, String> {
        let Some(path) = &o.file else {
            return Ok(None);
        };
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .append(o.append)
            .truncate(!o.append)
            .open(path)
            .map_err(|e| {
                // QEMU's qemu_create words.
                format!(
                    "Could not create '{}': {}",
                    path.display(),
                    crate::sys::os_text(&e)
                )
            })?;
        Ok(Some(Rc::new(RefCell::new(ChardevLog {
            file,
            timestamp: o.timestamp,
            line_start: true,
        }))))
    }

    /// Logs what the chardev sent (a failed log write is ignored, as QEMU ignores it).
    pub fn write(&mut self, buf: &[u8]) {
        if !self.timestamp {
            let _ = self.file.write_all(buf);
            return;
        }
        let stamp = iso8601_now();
        let mut rest = buf;
        while !rest.is_empty() {
            if self.line_start {
                let _ = self.file.write_all(stamp.as_bytes());
                let _ = self.file.write_all(b" ");
                self.line_start = false;
            }
            let end = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => i + 1,
                None => rest.len(),
            };
            let _ = self.file.write_all(&rest[..end]);
            self.line_start = rest[end - 1] == b'\n';
            rest = &rest[end..];
        }
    }
}

/// Now, as GLib's g_date_time_format_iso8601 writes a UTC time.
fn iso8601_now() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    iso8601(now.as_secs(), now.subsec_micros())
}

/// `secs` since the epoch and `micros` as `YYYY-MM-DDTHH:MM:SS[.ffffff]Z`.
fn iso8601(secs: u64, micros: u32) -> String {
    let (days, day_secs) = (secs / 86400, secs % 86400);
    // Howard Hinnant's civil_from_days, from 1970-01-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (day_secs / 3600, day_secs / 60 % 60, day_secs % 60);
    let frac = if micros == 0 {
        String::new()
    } else {
        format!(".{micros:06}")
    };
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}{frac}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_as_glib_writes_them() {
        assert_eq!(iso8601(0, 0), "1970-01-01T00:00:00Z");
        // The time of QEMU's own patch (Message-ID 20260201173633.413934).
        assert_eq!(
            iso8601(1_769_967_393, 413_934),
            "2026-02-01T17:36:33.413934Z"
        );
        assert_eq!(iso8601(951_782_400, 5), "2000-02-29T00:00:00.000005Z");
    }

    #[test]
    fn each_line_starts_with_the_time() {
        let dir = std::env::temp_dir().join(format!("stord-chrlog-{}", std::process::id()));
        let o = LogOptions {
            file: Some(dir.clone()),
            append: false,
            timestamp: true,
        };
        let log = ChardevLog::open(&o).unwrap().unwrap();
        log.borrow_mut().write(b"one\ntw");
        log.borrow_mut().write(b"o\n\nthree");
        let text = std::fs::read_to_string(&dir).unwrap();
        let _ = std::fs::remove_file(&dir);
        let lines: Vec<&str> = text.split('\n').collect();
        assert_eq!(lines.len(), 4, "{text:?}");
        for (line, want) in lines.iter().zip(["one", "two", "", "three"]) {
            let (stamp, rest) = line.split_once(' ').unwrap();
            assert!(stamp.ends_with('Z') && stamp.len() >= 20, "{stamp}");
            assert_eq!(rest, want);
        }
    }
}
