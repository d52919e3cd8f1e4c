//! The `stord` binary: parse the command line (or take the built-in default), run.

use std::process::ExitCode;

use stord::cli::{self, USAGE};
use stord::daemon::{default_job, repo_root, Daemon};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cl = match cli::parse(&args) {
        Ok(cl) => cl,
        Err(e) => {
            eprintln!("stord: {e}");
            eprintln!("Try 'stord --help' for more information.");
            return ExitCode::from(1);
        }
    };
    if cl.help {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if cl.version {
        println!("stord {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let mut banner = None;
    if cl.items.is_empty() {
        // STORD_DATA_DIR moves the built-in default's folder (tests use it).
        let data = std::env::var_os("STORD_DATA_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| repo_root().join("data"));
        match default_job(&data) {
            Ok((default, uri)) => {
                cl.items = default.items;
                banner = Some(uri);
            }
            Err(e) => {
                eprintln!(
                    "stord: cannot prepare the default image under {}: {e}",
                    data.display()
                );
                return ExitCode::from(1);
            }
        }
    }
    let mut daemon = match Daemon::new() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("stord: cannot start the main loop: {e}");
            return ExitCode::from(1);
        }
    };
    if let Err(e) = daemon.apply(cl) {
        eprintln!("stord: {e}");
        daemon.shutdown();
        return ExitCode::from(1);
    }
    if let Some(uri) = banner {
        println!("stord: serving the built-in default image; connect with:");
        println!("    nbdinfo '{uri}'");
        println!("    qemu-img info '{uri}'");
        println!("stord: press Ctrl-C to stop");
    }
    daemon.run();
    daemon.shutdown();
    ExitCode::SUCCESS
}
