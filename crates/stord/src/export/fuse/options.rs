//! The options of `--export type=fuse` / `block-export-add` with `type=fuse`.

use std::path::PathBuf;

use crate::cli::keyval::KeyVal;
use crate::export::ExportError;

/// `allow-other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllowOther {
    /// Only the mounting user (root) may access the file.
    Off,
    /// Everyone may (subject to the file mode).
    On,
    /// Try on, fall back to off.
    Auto,
}

/// Options of `--export type=fuse`.
pub struct FuseOptions {
    pub id: String,
    pub node_name: String,
    pub mountpoint: PathBuf,
    pub writable: bool,
    pub writethrough: bool,
    pub growable: bool,
    pub allow_other: AllowOther,
    pub iothreads: Vec<String>,
    /// `io-uring`: Some(true) on, Some(false) off, None auto.
    pub io_uring: Option<bool>,
}

impl FuseOptions {
    /// Parses the options after `type=fuse` (the caller took `type`).
    pub fn from_opts(kv: &mut KeyVal) -> Result<Self, ExportError> {
        let id = kv.take_required("id")?;
        let node_name = kv.take_required("node-name")?;
        let mountpoint = PathBuf::from(kv.take_required("mountpoint")?);
        let writable = kv.take_bool("writable", false)?;
        let growable = kv.take_bool("growable", false)?;
        let allow_other = match kv
            .take_choice("allow-other", &["off", "on", "auto"])?
            .as_deref()
        {
            Some("on") => AllowOther::On,
            Some("auto") => AllowOther::Auto,
            _ => AllowOther::Off,
        };
        let writethrough = kv.take_bool("writethrough", false)?;
        let _ = kv.take_bool("fixed-iothread", false)?;
        let iothreads = kv.take_list("iothread");
        let io_uring = match kv
            .take_choice("io-uring", &["on", "off", "auto"])?
            .as_deref()
        {
            Some("on") => Some(true),
            Some("off") | None => Some(false),
            _ => None,
        };
        Ok(Self {
            id,
            node_name,
            mountpoint,
            writable,
            writethrough,
            growable,
            allow_other,
            iothreads,
            io_uring,
        })
    }
}
