//! How the agent reaches the API server. A service proxy cannot use the in-cluster default:
//! `KUBERNETES_SERVICE_HOST` is the `kubernetes` Service's ClusterIP, which only a service
//! proxy makes reachable — on a fresh node, that proxy is us. So, as kubeadm's kube-proxy
//! (`clientConnection.kubeconfig`) and Cilium (`k8sServiceHost`) do, the address comes from
//! a kubeconfig or is given (`--api-server`, `ebpf.apiServer`); the in-cluster credentials
//! (the ServiceAccount's token and CA) are used with it.
//!
//! The client is kube's, with what client-go has and kube lacks layered on: a token file
//! read trimmed and again when it rotates (`token`), Retry-After honoured (`retry_after`),
//! caps on one watch event and one list page (`answer_cap`); and `ApiCounters`, what went
//! wrong, by kind.

mod answer_cap;
mod counters;
mod retry_after;
mod token;

use std::{path::Path, sync::Arc, time::Duration};

use anyhow::{Context as _, Result};

pub use answer_cap::{
    AnswerCaps, EventTooLarge, ListPageTooLarge, MAX_EVENT_BYTES, MAX_LIST_PAGE_BYTES,
};
pub use counters::{ApiCounters, ApiCounts, ApiErrorKind, resource_of};
pub use retry_after::{MAX_RETRIES, MAX_WAIT};

/// An error and every source under it, `outer: inner: cause`, each said once (kube's and
/// kube-runtime's messages often repeat their source's). "client error (Connect)" alone
/// hid that the CA did not match.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        let text = e.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = e.source();
    }
    out
}

/// The first error of type `T` in `error`'s chain, looking inside I/O errors too (an
/// `io::Error`'s `source` skips the error it wraps).
pub fn find_in_chain<'a, T: std::error::Error + 'static>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(found) = e.downcast_ref::<T>() {
            return Some(found);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(found) = find_in_chain::<T>(inner)
        {
            return Some(found);
        }
        next = e.source();
    }
    None
}

/// The API client for `config`: kube's, with a token file read as client-go reads it, and
/// Retry-After and the caps on a watch event and a list page layered on; `counters`
/// counts what goes wrong.
pub fn client(config: kube::Config, counters: &ApiCounters) -> Result<kube::Client> {
    client_with_caps(config, counters, AnswerCaps::default())
}

/// `client` with other caps (tests: a huge page without megabytes of objects).
pub fn client_with_caps(
    mut config: kube::Config,
    counters: &ApiCounters,
    caps: AnswerCaps,
) -> Result<kube::Client> {
    // kube reads a token file verbatim (a trailing newline made a header that could not
    // be sent) and caches it a minute; ours replaces it. Only where kube would have used
    // it: an inline token, a password or an auth provider comes first.
    let auth = &config.auth_info;
    let basic = auth.username.is_some() && auth.password.is_some();
    let token_file = if auth.token.is_none() && !basic && auth.auth_provider.is_none() {
        config.auth_info.token_file.take()
    } else {
        None
    };
    let token = token_file
        .map(|path| token::TokenFile::open(path).map(Arc::new))
        .transpose()?;
    let builder =
        kube::client::ClientBuilder::try_from(config).context("building the API client")?;
    Ok(builder
        .with_layer(&token::TokenLayer(token))
        .with_layer(&answer_cap::AnswerCapLayer(caps))
        .with_layer(&retry_after::RetryAfterLayer(counters.clone()))
        .build())
}

/// Where the client's address and credentials come from, in the order they are tried.
#[derive(Clone, Debug, Default)]
pub struct ApiServerOptions {
    /// A kubeconfig file (flag, or the config file's `clientConnection.kubeconfig`).
    pub kubeconfig: Option<String>,
    /// The API server's URL, overriding the kubeconfig's or the in-cluster one.
    pub api_server: Option<String>,
}

/// Builds the client configuration: the kubeconfig if given, else the in-cluster
/// credentials at `api_server`, else kube's inference (local kubeconfig, then in-cluster).
pub async fn client_config(opts: &ApiServerOptions) -> Result<kube::Config> {
    let mut config = match (&opts.kubeconfig, &opts.api_server) {
        (Some(path), _) => {
            let kc = kube::config::Kubeconfig::read_from(Path::new(path))
                .with_context(|| format!("reading kubeconfig {path}"))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("using kubeconfig {path}"))?
        }
        (None, Some(url)) => kube::Config::incluster_dns().with_context(|| {
            format!(
                "--api-server {url}: no ServiceAccount token and CA to use with it \
                 (/var/run/secrets/kubernetes.io/serviceaccount); give --kubeconfig"
            )
        })?,
        (None, None) => {
            let config = kube::Config::infer().await.context(
                "no kubeconfig and no in-cluster config: give --kubeconfig or --api-server",
            )?;
            if let Some(ip) = in_cluster_service_ip(&config) {
                tracing::warn!(
                    url = %config.cluster_url,
                    "the API server address is the `kubernetes` Service's ClusterIP ({ip}), \
                     which only a service proxy makes reachable: on a node without one, set \
                     --api-server (ebpf.apiServer) or clientConnection.kubeconfig"
                );
            }
            config
        }
    };
    if let Some(url) = &opts.api_server {
        config.cluster_url = url
            .parse()
            .with_context(|| format!("--api-server (ebpf.apiServer): invalid URL {url:?}"))?;
    }
    Ok(config)
}

/// The ClusterIP the in-cluster environment points at, when `config` uses it.
fn in_cluster_service_ip(config: &kube::Config) -> Option<String> {
    let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
    let url_host = config.cluster_url.host()?.trim_matches(['[', ']']);
    (url_host == host.trim_matches(['[', ']'])).then_some(host)
}

/// Waits until the API server answers, logging a clear error (address and cause) each time
/// it does not; the pinned programs keep serving meanwhile.
pub async fn wait_reachable(client: &kube::Client, url: &str) {
    let mut delay = Duration::from_secs(1);
    loop {
        match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
            Ok(Ok(v)) => {
                tracing::info!(%url, version = %v.git_version, "API server reachable");
                return;
            }
            // It answered: the address is right, the credentials are not.
            Ok(Err(kube::Error::Api(e))) if e.code == 401 || e.code == 403 => tracing::error!(
                %url,
                code = e.code,
                error = %e.message,
                "the API server refused our credentials; retrying (check the token or \
                 client certificate, and the ServiceAccount's RBAC)"
            ),
            Ok(Err(e)) => tracing::error!(
                %url,
                error = error_chain(&e),
                "cannot reach the API server; retrying (set --api-server, ebpf.apiServer or \
                 clientConnection.kubeconfig if this is not its address)"
            ),
            Err(_) => tracing::error!(
                %url,
                "the API server did not answer within 10 s; retrying (set --api-server, \
                 ebpf.apiServer or clientConnection.kubeconfig if this is not its address)"
            ),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn api_server_overrides_the_kubeconfig_address() {
        let dir = std::env::temp_dir().join(format!("api-server-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \
             'https://10.96.0.1:443', insecure-skip-tls-verify: true}\ncontexts:\n- name: c\n  \
             context: {cluster: c, user: u}\ncurrent-context: c\nusers:\n- name: u\n  user: \
             {token: abc}\n",
        )
        .unwrap();
        let mut opts = ApiServerOptions {
            kubeconfig: Some(path.display().to_string()),
            api_server: None,
        };
        let c = client_config(&opts).await.unwrap();
        assert_eq!(c.cluster_url.to_string(), "https://10.96.0.1:443/");
        opts.api_server = Some("https://192.0.2.10:6443".into());
        let c = client_config(&opts).await.unwrap();
        assert_eq!(c.cluster_url.to_string(), "https://192.0.2.10:6443/");
        opts.api_server = Some("not a url".into());
        let e = client_config(&opts).await.unwrap_err();
        assert!(format!("{e:#}").contains("invalid URL"), "{e:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
