//! The `stord` binary: parse the command line (or take the built-in default), run.

use std::os::unix::net::UnixStream;
use std::process::ExitCode;

use stord::cli::{self, CommandLine};
use stord::process::{default_data_dir, default_job, Daemon};

/// A step of the start: `Err` means leave now with that status (the step has said why, or
/// printed what was asked for).
type Step<T> = Result<T, ExitCode>;

fn main() -> ExitCode {
    run().unwrap_or_else(|status| status)
}

/// Parse, set up logging and tracing, answer what needs no daemon, build the daemon, run
/// its loop, leave.
fn run() -> Step<ExitCode> {
    let mut cl = parse()?;
    set_up_logging(&cl)?;
    answer_without_daemon(&mut cl)?;
    let mut ready_pipe = daemonize(&cl)?;
    let banner = default_image(&mut cl)?;
    let mut daemon = build_daemon(cl, &mut ready_pipe)?;
    if let Some(uri) = banner {
        println!("stord: serving the built-in default image; connect with:");
        println!("    nbdinfo '{uri}'");
        println!("    qemu-img info '{uri}'");
        println!("stord: press Ctrl-C to stop");
    }
    daemon.run();
    Ok(leave(daemon))
}

/// The command line, parsed.
fn parse() -> Step<CommandLine> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    cli::parse(&args).map_err(|e| {
        stord::log::init();
        eprintln!("stord: {e}");
        eprintln!("Try 'stord --help' for more information.");
        ExitCode::from(1)
    })
}

/// The log subscriber, with the `--trace` events enabled (`--trace help` lists them).
fn set_up_logging(cl: &CommandLine) -> Step<()> {
    if cl.trace.iter().any(|t| t == "help" || t == "enable=help") {
        print!("{}", stord::trace::help());
        return Err(ExitCode::SUCCESS);
    }
    let traced = stord::trace::TraceConfig::from_options(&cl.trace)
        .and_then(|t| stord::log::init_with(&t).map_err(|e| format!("--trace file: {e}")));
    if let Err(e) = traced {
        eprintln!("stord: {e}");
        return Err(ExitCode::from(1));
    }
    Ok(())
}

/// `--help`, `--object help` and `--version`: answered, and nothing else done.
fn answer_without_daemon(cl: &mut CommandLine) -> Step<()> {
    if cl.help {
        print!("{}", stord::usage::text());
        return Err(ExitCode::SUCCESS);
    }
    if let Some(value) = cl.object_help.take() {
        return Err(match stord::usage::object_help(&value) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("stord: {e}");
                ExitCode::from(1)
            }
        });
    }
    if cl.version {
        print!("{}", stord::version::version_text());
        return Err(ExitCode::SUCCESS);
    }
    Ok(())
}

/// `--daemonize`: fork now, before any thread exists. The parent waits for the child to
/// report "ready" (or an error) through a pipe, and exits accordingly; the child goes on
/// with its end of the pipe.
fn daemonize(cl: &CommandLine) -> Step<Option<UnixStream>> {
    if !cl.daemonize {
        return Ok(None);
    }
    let (mut parent_end, child_end) = match UnixStream::pair() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("stord: --daemonize: {e}");
            return Err(ExitCode::from(1));
        }
    };
    match stord::sys::fork() {
        Err(e) => {
            eprintln!("stord: --daemonize: fork failed: {e}");
            Err(ExitCode::from(1))
        }
        Ok(Some(_child)) => {
            drop(child_end);
            let mut msg = String::new();
            use std::io::Read;
            let _ = parent_end.read_to_string(&mut msg);
            if msg == "ok" {
                return Err(ExitCode::SUCCESS);
            }
            eprint!("{msg}");
            Err(ExitCode::from(1))
        }
        Ok(None) => {
            drop(parent_end);
            let _ = stord::sys::setsid();
            Ok(Some(child_end))
        }
    }
}

/// Tells a waiting `--daemonize` parent how the start went (once).
fn report(pipe: &mut Option<UnixStream>, msg: &str) {
    if let Some(mut p) = pipe.take() {
        use std::io::Write;
        let _ = p.write_all(msg.as_bytes());
    }
}

/// A command line with nothing to do gets the built-in default (an image served over NBD);
/// returns the URI to tell the user, if so.
fn default_image(cl: &mut CommandLine) -> Step<Option<String>> {
    if !cl.items.is_empty() {
        return Ok(None);
    }
    let data = default_data_dir();
    match default_job(&data) {
        Ok((default, uri)) => {
            cl.items = default.items;
            Ok(Some(uri))
        }
        Err(e) => {
            eprintln!(
                "stord: cannot prepare the default image under {}: {e}",
                data.display()
            );
            Err(ExitCode::from(1))
        }
    }
}

/// The daemon, with the command line applied; a `--daemonize` parent hears how it went.
fn build_daemon(cl: CommandLine, ready_pipe: &mut Option<UnixStream>) -> Step<Daemon> {
    let mut daemon = match Daemon::new() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("stord: cannot start the main loop: {e}");
            report(
                ready_pipe,
                &format!("stord: cannot start the main loop: {e}\n"),
            );
            return Err(ExitCode::from(1));
        }
    };
    if let Err(e) = daemon.apply(cl) {
        eprintln!("stord: {e}");
        report(ready_pipe, &format!("stord: {e}\n"));
        daemon.shutdown();
        return Err(ExitCode::from(1));
    }
    if ready_pipe.is_some() {
        let _ = stord::sys::stdio_to_devnull();
        report(ready_pipe, "ok");
    }
    if let Err(e) = stord::sys::notify_ready() {
        tracing::warn!("cannot tell the service manager that stord is ready: {e}");
    }
    Ok(daemon)
}

/// Stops the daemon and leaves: without destructors or exit handlers where storage that
/// does not answer still holds a thread.
fn leave(mut daemon: Daemon) -> ExitCode {
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
