//! The commands of `proxy-agent`, one module each, and their standard output.

/// `println!` for a command's output, in a function returning `anyhow::Result`: a reader
/// that went away (`proxy-agent dump | head`) returns [`output::Closed`] through `?`,
/// which `main` ends quietly.
macro_rules! outln {
    () => {
        $crate::cli::output::write(format_args!("\n"))?
    };
    ($($arg:tt)*) => {
        $crate::cli::output::write(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

/// `print!` as [`outln!`] is `println!`.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::output::write(format_args!($($arg)*))?
    };
}

pub mod output;

pub mod agent_client;
pub mod cleanup;
pub mod dump;
pub mod log;
pub mod run;
pub mod serve;
pub mod source;
pub mod trace;
