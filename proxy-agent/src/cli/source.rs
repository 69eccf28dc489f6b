//! The source flags `run` and `serve` share, and the two sources both start from them:
//! a folder of manifests, and the API server's client.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use proxy_agent::{
    model::NodeInfo,
    source::{self, SharedSnapshot, api_server},
};
use tokio::sync::watch;

/// Where the objects come from, besides `--source` (whose choices differ by command).
#[derive(Args)]
pub struct SourceArgs {
    /// Folder of Kubernetes manifests (Services, EndpointSlices), re-read on change
    /// (`--source files`).
    #[arg(long, default_value = "deploy/examples")]
    pub manifests: PathBuf,
    /// kubeconfig for `--source kube`; default: the config file's (`run --config`), else
    /// in-cluster, else ~/.kube/config.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's URL for `--source kube` (`https://HOST:PORT`), overriding the
    /// kubeconfig's; with no kubeconfig, used with the in-cluster ServiceAccount
    /// credentials (the in-cluster address is a ClusterIP that only a proxy serves).
    #[arg(long, env = "PROXY_AGENT_API_SERVER")]
    pub api_server: Option<String>,
}

impl SourceArgs {
    /// The manifests' folder, which must exist: a typo must not leave a node (or every
    /// node a server feeds) with no source.
    pub fn existing_manifests(&self) -> Result<PathBuf> {
        anyhow::ensure!(
            self.manifests.exists(),
            "--manifests {}: no such file or folder",
            self.manifests.display()
        );
        Ok(self.manifests.clone())
    }
}

/// Follows the manifests in `dir` as `node` sees them, sending each snapshot to `tx`.
pub fn spawn_files(dir: PathBuf, node: NodeInfo, tx: watch::Sender<Option<SharedSnapshot>>) {
    tokio::spawn(async move {
        if let Err(e) = source::files::follow::run(dir, node, tx).await {
            tracing::error!(error = format!("{e:#}"), "file source stopped");
        }
    });
}

/// The API server's client, counting its errors in `counters`, and its URL.
pub async fn kube_client(
    api: &api_server::ApiServerOptions,
    counters: &api_server::ApiCounters,
) -> Result<(kube::Client, String)> {
    let config = api_server::client_config(api).await?;
    let url = config.cluster_url.to_string();
    Ok((api_server::client(config, counters)?, url))
}

#[cfg(test)]
mod tests {
    use clap::{Args as _, Command};

    use super::super::{run::RunArgs, serve::ServeArgs};

    /// One declaration: the same names, environment variable, default and help in both.
    #[test]
    fn run_and_serve_take_the_source_flags_alike() {
        let run = RunArgs::augment_args(Command::new("run"));
        let serve = ServeArgs::augment_args(Command::new("serve"));
        for id in ["manifests", "kubeconfig", "api_server"] {
            // All but the place in the help (`disp_ord`).
            let find = |cmd: &Command| {
                cmd.get_arguments().find(|a| a.get_id() == id).map(|a| {
                    format!(
                        "{:?} {:?} {:?} {:?} {:?}",
                        a.get_long(),
                        a.get_env(),
                        a.get_default_values(),
                        a.get_help().map(ToString::to_string),
                        a.get_value_names(),
                    )
                })
            };
            let (in_run, in_serve) = (find(&run), find(&serve));
            assert!(in_run.is_some(), "{id}");
            assert_eq!(in_run, in_serve, "{id}");
        }
        let api = serve
            .get_arguments()
            .find(|a| a.get_id() == "api_server")
            .and_then(|a| a.get_env().map(|e| e.to_os_string()));
        assert_eq!(api.as_deref(), Some("PROXY_AGENT_API_SERVER".as_ref()));
    }
}
