//! A bearer token read from a file, as client-go reads a ServiceAccount's: trimmed of
//! surrounding whitespace (an `echo`ed token ends in a newline, which no header may hold:
//! kube sent no token at all), and read again when the file changes (kubelet rotates a
//! bound token about hourly, swapping the file) or at least once a minute. A file that
//! cannot be read again keeps the last token (kubernetes#68164: some clients remove it).

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use http::{HeaderValue, Request, header::AUTHORIZATION};

/// How long a token is used before the file is read again even if it looks unchanged.
const REREAD_EVERY: Duration = Duration::from_secs(60);

/// What tells one version of the file from the next without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt as _;
    // Follows symlinks: kubelet's `..data` swap changes the file the path resolves to.
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
        inode: m.ino(),
    })
}

struct Cached {
    header: HeaderValue,
    stamp: Option<Stamp>,
    read_at: Instant,
}

/// A token file and the header made from its last good reading.
pub struct TokenFile {
    path: PathBuf,
    cached: Mutex<Cached>,
}

/// `Bearer TOKEN`, marked sensitive (kept out of debug output), from the file's text.
fn bearer(path: &Path, text: &str) -> Result<HeaderValue> {
    let token = text.trim();
    anyhow::ensure!(!token.is_empty(), "token file {} is empty", path.display());
    let mut header = HeaderValue::from_str(&format!("Bearer {token}")).with_context(|| {
        format!(
            "token file {}: the token holds characters a header cannot",
            path.display()
        )
    })?;
    header.set_sensitive(true);
    Ok(header)
}

impl TokenFile {
    /// Reads the token now: a missing, empty or unusable file is an error at start.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let stamp = stamp(&path);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the token file {}", path.display()))?;
        let header = bearer(&path, &text)?;
        Ok(Self {
            path,
            cached: Mutex::new(Cached {
                header,
                stamp,
                read_at: Instant::now(),
            }),
        })
    }

    /// The header to send: the file read again if it changed or a minute has passed.
    pub fn header(&self) -> HeaderValue {
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        let now_stamp = stamp(&self.path);
        if now_stamp != cached.stamp || cached.read_at.elapsed() >= REREAD_EVERY {
            match std::fs::read_to_string(&self.path)
                .with_context(|| format!("reading the token file {}", self.path.display()))
                .and_then(|text| bearer(&self.path, &text))
            {
                Ok(header) => cached.header = header,
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "keeping the last token read from its file"
                ),
            }
            cached.stamp = now_stamp;
            cached.read_at = Instant::now();
        }
        cached.header.clone()
    }
}

/// Sets `Authorization` from a token file on every request (when there is one).
#[derive(Clone)]
pub struct TokenLayer(pub Option<Arc<TokenFile>>);

impl<S> tower::Layer<S> for TokenLayer {
    type Service = TokenAuth<S>;
    fn layer(&self, inner: S) -> TokenAuth<S> {
        TokenAuth {
            inner,
            file: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct TokenAuth<S> {
    inner: S,
    file: Option<Arc<TokenFile>>,
}

impl<S, B> tower::Service<Request<B>> for TokenAuth<S>
where
    S: tower::Service<Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        if let Some(file) = &self.file {
            request.headers_mut().insert(AUTHORIZATION, file.header());
        }
        Box::pin(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_trimmed_and_read_again_when_the_file_changes() {
        let dir = std::env::temp_dir().join(format!("token-file-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "first\n").unwrap();
        let file = TokenFile::open(&path).unwrap();
        assert_eq!(file.header(), "Bearer first");
        assert!(file.header().is_sensitive());
        // Rotated as kubelet does: a new file renamed over the old one.
        std::fs::write(dir.join("token.new"), "  second-token\r\n").unwrap();
        std::fs::rename(dir.join("token.new"), &path).unwrap();
        assert_eq!(file.header(), "Bearer second-token");
        // Gone: the last token stays.
        std::fs::remove_file(&path).unwrap();
        assert_eq!(file.header(), "Bearer second-token");
        std::fs::write(&path, "\n").unwrap();
        assert_eq!(
            file.header(),
            "Bearer second-token",
            "an empty file is ignored"
        );
        assert!(TokenFile::open(&path).is_err(), "but refused at start");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
