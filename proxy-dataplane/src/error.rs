//! The dataplane's error: what failed (`ErrorKind`, for branching and counting), what it
//! was doing (the text, for the log), and the error underneath (aya's, the kernel's).
//! A leaf: every module of the crate names it, it names none of them.

use std::fmt;

/// The part of the dataplane that failed. The runner counts failures by it
/// (`proxy_dataplane_errors_total{kind}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Loading the BPF object or a program into the kernel (the verifier, a missing
    /// program type or helper).
    Load,
    /// Attaching a program: cgroup hooks, TC, XDP, BPF links and their pins.
    Attach,
    /// Reading, writing or pinning a BPF map.
    Map,
    /// A netlink exchange with the kernel: devices, qdiscs, conntrack, socket diagnostics.
    Netlink,
    /// The kernel lacks what a setting needs (a probe said so).
    Kernel,
    /// A setting the dataplane cannot carry out as given (e.g. native XDP on a device
    /// without it).
    Setting,
    /// Files, namespaces and sockets outside the above (/proc, /sys, bpffs folders).
    Io,
}

impl ErrorKind {
    /// Every kind, in order: a counter per kind starts at zero.
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::Load,
        ErrorKind::Attach,
        ErrorKind::Map,
        ErrorKind::Netlink,
        ErrorKind::Kernel,
        ErrorKind::Setting,
        ErrorKind::Io,
    ];

    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Load => "load",
            ErrorKind::Attach => "attach",
            ErrorKind::Map => "map",
            ErrorKind::Netlink => "netlink",
            ErrorKind::Kernel => "kernel",
            ErrorKind::Setting => "setting",
            ErrorKind::Io => "io",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A dataplane failure. `{}` prints what it was doing; `{:#}` adds every cause, as
/// anyhow's `{:#}` does (the agent logs it so). One converted by `?` from aya's or the
/// kernel's error without a word of its own is transparent: it prints as its cause.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    /// `None`: transparent.
    what: Option<String>,
    source: Option<Cause>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A failure with no error underneath.
    pub fn new(kind: ErrorKind, what: impl Into<String>) -> Self {
        Self {
            kind,
            what: Some(what.into()),
            source: None,
        }
    }

    /// A failure caused by `source`.
    pub fn caused(
        kind: ErrorKind,
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            what: Some(what.into()),
            source: Some(Box::new(source)),
        }
    }

    /// This error as the cause of a step that was doing `what` (its kind stays).
    pub fn context(self, what: impl Into<String>) -> Self {
        Self {
            kind: self.kind,
            what: Some(what.into()),
            source: Some(Box::new(self)),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The first error of type `T` in the chain, this one's cause first.
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        let mut next = self
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static));
        while let Some(e) = next {
            if let Some(found) = e.downcast_ref::<T>() {
                return Some(found);
            }
            next = match e.downcast_ref::<Error>() {
                Some(ours) => ours.source.as_deref().map(|e| e as _),
                None => e.source(),
            };
        }
        None
    }

    /// The errno of the kernel's refusal underneath, if one is.
    pub fn errno(&self) -> Option<i32> {
        self.downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
    }
}

impl Error {
    /// What `Display` starts with: its own words, or a transparent error's cause.
    fn head(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self.what {
            Some(_) => None,
            None => self.source.as_deref().map(|e| e as _),
        }
    }

    /// A transparent conversion: the cause speaks for itself.
    pub(crate) fn transparent(
        kind: ErrorKind,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            what: None,
            source: Some(Box::new(source)),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut next = match (&self.what, self.head()) {
            (Some(what), _) => {
                f.write_str(what)?;
                self.source.as_deref().map(|e| e as &dyn std::error::Error)
            }
            (None, Some(head)) => {
                write!(f, "{head}")?;
                head.source()
            }
            (None, None) => return Ok(()),
        };
        if f.alternate() {
            while let Some(e) = next {
                write!(f, ": {e}")?;
                next = e.source();
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self.head() {
            Some(head) => head.source(),
            None => self.source.as_deref().map(|e| e as _),
        }
    }
}

/// `?` on aya's and the kernel's errors: the kind follows from the error's type.
macro_rules! kind_of_type {
    ($($ty:ty => $kind:ident),* $(,)?) => {$(
        impl From<$ty> for Error {
            fn from(e: $ty) -> Self {
                Self::transparent(ErrorKind::$kind, e)
            }
        }
    )*};
}

kind_of_type! {
    aya::maps::MapError => Map,
    aya::programs::ProgramError => Load,
    aya::programs::links::LinkError => Attach,
    std::io::Error => Io,
    std::ffi::NulError => Io,
    std::num::ParseIntError => Io,
}

/// What a step was doing, on a dataplane error: the kind stays the cause's.
pub trait Context<T> {
    fn context(self, what: impl Into<String>) -> Result<T>;
    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T> Context<T> for Result<T> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| e.context(what))
    }

    fn with_context<S: Into<String>>(self, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| e.context(what()))
    }
}

/// A foreign error (aya's, the kernel's, a parser's) as a dataplane error of `kind`.
pub trait Kind<T> {
    fn kind(self, kind: ErrorKind, what: impl Into<String>) -> Result<T>;
    fn kind_with<S: Into<String>>(self, kind: ErrorKind, what: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Kind<T> for Result<T, E> {
    fn kind(self, kind: ErrorKind, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::caused(kind, what, e))
    }

    fn kind_with<S: Into<String>>(self, kind: ErrorKind, what: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| Error::caused(kind, what(), e))
    }
}

impl<T> Kind<T> for Option<T> {
    fn kind(self, kind: ErrorKind, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| Error::new(kind, what))
    }

    fn kind_with<S: Into<String>>(self, kind: ErrorKind, what: impl FnOnce() -> S) -> Result<T> {
        self.ok_or_else(|| Error::new(kind, what()))
    }
}

/// `return Err(..)` of a new dataplane error: `fail!(ErrorKind::Setting, "format", args)`.
macro_rules! fail {
    ($kind:expr, $($arg:tt)+) => {
        return Err($crate::error::Error::new($kind, format!($($arg)+)))
    };
}
pub(crate) use fail;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternate_display_prints_every_cause_and_the_kind_stays_the_first() {
        let io: std::result::Result<(), _> = Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        let e = io
            .kind(ErrorKind::Map, "writing backend")
            .context("applying web")
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Map);
        assert_eq!(e.to_string(), "applying web");
        assert!(
            format!("{e:#}").starts_with("applying web: writing backend: No space left"),
            "{e:#}"
        );
        assert_eq!(e.errno(), Some(libc::ENOSPC));
        assert_eq!(Error::new(ErrorKind::Kernel, "no BTF").errno(), None);
    }

    #[test]
    fn a_conversion_by_question_mark_prints_as_its_cause_once() {
        let e = Error::from(std::io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(e.kind(), ErrorKind::Io);
        assert_eq!(e.to_string(), format!("{e:#}"));
        assert!(std::error::Error::source(&e).is_none());
        assert_eq!(e.errno(), Some(libc::EPERM));
        let wrapped = Err::<(), _>(e).context("reading a pin").unwrap_err();
        assert_eq!(
            format!("{wrapped:#}"),
            format!(
                "reading a pin: {}",
                std::io::Error::from_raw_os_error(libc::EPERM)
            )
        );
    }
}
