//! The `stord` binary: parse the command line (or take the built-in default), run.

use std::process::ExitCode;

use stord::cli;
use stord::process::{default_job, repo_root, Daemon};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cl = match cli::parse(&args) {
        Ok(cl) => cl,
        Err(e) => {
            stord::log::init();
            eprintln!("stord: {e}");
            eprintln!("Try 'stord --help' for more information.");
            return ExitCode::from(1);
        }
    };
    if cl.trace.iter().any(|t| t == "help" || t == "enable=help") {
        print!("{}", stord::trace::help());
        return ExitCode::SUCCESS;
    }
    let traced = stord::trace::TraceConfig::from_options(&cl.trace)
        .and_then(|t| stord::log::init_with(&t).map_err(|e| format!("--trace file: {e}")));
    if let Err(e) = traced {
        eprintln!("stord: {e}");
        return ExitCode::from(1);
    }
    if cl.help {
        print!("{}", stord::usage::text());
        return ExitCode::SUCCESS;
    }
    if let Some(value) = cl.object_help.take() {
        return match stord::usage::object_help(&value) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("stord: {e}");
                ExitCode::from(1)
            }
        };
    }
    if cl.version {
        println!("stord {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    // --daemonize: fork now, before any thread exists. The parent waits for the child to
    // report "ready" (or an error) through a pipe, and exits accordingly.
    let mut ready_pipe: Option<std::os::unix::net::UnixStream> = None;
    if cl.daemonize {
        let (mut parent_end, child_end) = match std::os::unix::net::UnixStream::pair() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("stord: --daemonize: {e}");
                return ExitCode::from(1);
            }
        };
        match stord::sys::fork() {
            Err(e) => {
                eprintln!("stord: --daemonize: fork failed: {e}");
                return ExitCode::from(1);
            }
            Ok(Some(_child)) => {
                drop(child_end);
                let mut msg = String::new();
                use std::io::Read;
                let _ = parent_end.read_to_string(&mut msg);
                if msg == "ok" {
                    return ExitCode::SUCCESS;
                }
                eprint!("{msg}");
                return ExitCode::from(1);
            }
            Ok(None) => {
                drop(parent_end);
                let _ = stord::sys::setsid();
                ready_pipe = Some(child_end);
            }
        }
    }
    let report = |pipe: &mut Option<std::os::unix::net::UnixStream>, msg: &str| {
        if let Some(mut p) = pipe.take() {
            use std::io::Write;
            let _ = p.write_all(msg.as_bytes());
        }
    };
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
            report(
                &mut ready_pipe,
                &format!("stord: cannot start the main loop: {e}\n"),
            );
            return ExitCode::from(1);
        }
    };
    if let Err(e) = daemon.apply(cl) {
        eprintln!("stord: {e}");
        report(&mut ready_pipe, &format!("stord: {e}\n"));
        daemon.shutdown();
        return ExitCode::from(1);
    }
    if ready_pipe.is_some() {
        let _ = stord::sys::stdio_to_devnull();
        report(&mut ready_pipe, "ok");
    }
    if let Some(uri) = banner {
        println!("stord: serving the built-in default image; connect with:");
        println!("    nbdinfo '{uri}'");
        println!("    qemu-img info '{uri}'");
        println!("stord: press Ctrl-C to stop");
    }
    daemon.run();
    if !daemon.shutdown() {
        eprintln!("stord: stopped with requests abandoned in storage that did not answer");
        // Threads stuck in that storage cannot be joined: leave without destructors (and
        // without the libraries' exit handlers, which could wait on those threads).
        stord::sys::exit_now(1);
    }
    if stord::block::helper_thread::closes_pending() > 0 {
        // A close that outlived its bound (storage that does not answer) still runs:
        // leave without the libraries' exit handlers, which could wait on it.
        stord::sys::exit_now(0);
    }
    ExitCode::SUCCESS
}
