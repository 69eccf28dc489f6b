//! A cluster in a box: etcd, kube-apiserver and kube-controller-manager as upstream
//! builds them (`cargo xtask cluster --build-only`), listening on 127.0.0.1 only, with
//! real TLS, RBAC and ServiceAccount tokens — and no kubelet, no container runtime: a
//! test stands in for the kubelet by writing Pod status. Processes, certificates and data
//! are removed on drop, also when a test fails.

use std::{
    collections::HashMap,
    fs::{self, File, OpenOptions},
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::{
    authentication::v1::{TokenRequest, TokenRequestSpec},
    core::v1::{Namespace, ServiceAccount},
};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Set by `cargo xtask` to the folder holding the three binaries.
pub const BIN_DIR_ENV: &str = "PROXY_CLUSTER_BIN_DIR";
const BINARIES: [&str; 3] = ["etcd", "kube-apiserver", "kube-controller-manager"];
/// Everything listens here, and only here.
const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// The only controllers a cluster without kubelets wants: no node lifecycle (it would
/// taint our kubelet-less Nodes and evict their Pods), no Pod garbage collector.
const CONTROLLERS: &str = "endpointslice-controller,serviceaccount-controller,\
    root-ca-certificate-publisher-controller,namespace-controller,garbage-collector-controller";
/// What a box with kubelets adds: workloads' controllers, and the ones that keep Pods and
/// Endpoints as a real cluster does.
const NODE_CONTROLLERS: &str = "daemonset-controller,deployment-controller,replicaset-controller,\
    replicationcontroller-controller,endpoints-controller,pod-garbage-collector-controller,\
    ttl-after-finished-controller,job-controller,taint-eviction-controller,\
    node-lifecycle-controller";
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a component gets to shut down on SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// The binaries' folder `cargo xtask` announced, if all three are built there; else why not.
pub fn built_binaries() -> Result<PathBuf, String> {
    let dir = std::env::var_os(BIN_DIR_ENV)
        .map(PathBuf::from)
        .ok_or_else(|| {
            format!("{BIN_DIR_ENV} is not set (run through `cargo xtask test`, or set it)")
        })?;
    match BINARIES.iter().find(|b| !dir.join(b).is_file()) {
        Some(missing) => Err(format!(
            "no {missing} in {} (build it: `cargo xtask cluster --build-only`)",
            dir.display()
        )),
        None => Ok(dir),
    }
}

/// For tests: the binaries' folder. Without them the test fails, saying how to build
/// them: `cargo xtask test` builds them first, and a test that did not run must never
/// count as passed.
pub fn require_binaries(test: &str) -> PathBuf {
    built_binaries()
        .unwrap_or_else(|why| panic!("{test} needs the cluster-in-a-box binaries: {why}"))
}

/// What [`Cluster::start`] runs.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Folder holding etcd, kube-apiserver and kube-controller-manager.
    pub bin_dir: PathBuf,
    /// `--service-cluster-ip-range`: where ClusterIPs are allocated. Virtual: nothing
    /// routes them.
    pub service_cidr: String,
    /// `--min-request-timeout`: the server ends each watch after between this and twice
    /// this (upstream's default is 1800 s); shorten it to exercise watch expiry.
    pub min_request_timeout: Duration,
    /// More kube-apiserver flags, after ours (the later of two equal flags wins).
    pub apiserver_args: Vec<String>,
    /// kube-controller-manager's `--controllers`.
    pub controllers: String,
    /// Runs kube-scheduler too (a box with real nodes, whose Pods name no node).
    pub scheduler: bool,
}

impl ClusterOptions {
    pub fn new(bin_dir: impl Into<PathBuf>) -> Self {
        ClusterOptions {
            bin_dir: bin_dir.into(),
            service_cidr: "10.96.0.0/16".into(),
            min_request_timeout: Duration::from_secs(1800),
            apiserver_args: Vec::new(),
            controllers: CONTROLLERS.into(),
            scheduler: false,
        }
    }

    /// A box with real nodes ([`crate::node::Nodes`]): the scheduler, and the controllers
    /// that Deployments, ReplicationControllers and DaemonSets need.
    pub fn with_nodes(bin_dir: impl Into<PathBuf>) -> Self {
        ClusterOptions {
            controllers: format!("{CONTROLLERS},{NODE_CONTROLLERS}"),
            scheduler: true,
            // As kubeadm runs it: the agent's init container (mount) and the e2e specs'
            // host-exec Pods are privileged.
            apiserver_args: vec!["--allow-privileged=true".into()],
            ..ClusterOptions::new(bin_dir)
        }
    }
}

/// A running cluster. Dropping it stops every process and removes its folder.
pub struct Cluster {
    opts: ClusterOptions,
    dir: PathBuf,
    etcd_port: u16,
    api_port: u16,
    ca: Issuer<'static, KeyPair>,
    admin_kubeconfig: PathBuf,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    controller_manager: Option<Child>,
    scheduler: Option<Child>,
    keeper: Keeper,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

impl Cluster {
    /// Starts etcd, kube-apiserver and kube-controller-manager and returns once the API
    /// server is ready and the controllers run (the `default` ServiceAccount exists).
    pub async fn start(opts: ClusterOptions) -> Result<Self> {
        let (etcd_port, api_port, keeper) = (free_port()?, free_port()?, Keeper::new()?);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pxy-cluster-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for sub in ["pki", "etcd", "logs"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let ca = match write_pki(&dir.join("pki"), &opts.service_cidr) {
            Ok(ca) => ca,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(e.context("writing the cluster's certificates"));
            }
        };
        let mut cluster = Cluster {
            etcd_port,
            api_port,
            admin_kubeconfig: dir.join("admin.kubeconfig"),
            dir,
            opts,
            ca,
            etcd: None,
            apiserver: None,
            controller_manager: None,
            scheduler: None,
            keeper,
        };
        // On error the cluster is dropped here, which stops what started.
        cluster.boot().await?;
        Ok(cluster)
    }

    async fn boot(&mut self) -> Result<()> {
        self.start_etcd()?;
        self.write_client_kubeconfig(
            &self.admin_kubeconfig.clone(),
            "kubernetes-admin",
            &["system:masters"],
        )?;
        let kcm_kubeconfig = self.dir.join("controller-manager.kubeconfig");
        // The user the RBAC bootstrap policy lets read what the controllers share and mint
        // each controller's ServiceAccount token.
        self.write_client_kubeconfig(&kcm_kubeconfig, "system:kube-controller-manager", &[])?;
        self.start_apiserver().await?;
        let pki = self.dir.join("pki");
        let mut kcm = Command::new(self.opts.bin_dir.join("kube-controller-manager"));
        kcm.arg(format!("--kubeconfig={}", kcm_kubeconfig.display()))
            .arg(format!("--bind-address={LOOPBACK}"))
            // No serving endpoint at all: nothing of ours asks it anything.
            .arg("--secure-port=0")
            .arg("--leader-elect=false")
            // Each controller as its own ServiceAccount (tokens from the TokenRequest
            // API), as kubeadm runs them: the bootstrap RBAC policy grants the
            // controllers' permissions to those (`system:controller:*`), not to
            // `system:kube-controller-manager`.
            .arg("--use-service-account-credentials=true")
            .arg(format!("--controllers={}", self.opts.controllers))
            .arg(format!("--root-ca-file={}", pki.join("ca.crt").display()));
        self.controller_manager = Some(self.spawn("kube-controller-manager", kcm)?);
        if self.opts.scheduler {
            let kubeconfig = self.dir.join("scheduler.kubeconfig");
            self.write_client_kubeconfig(&kubeconfig, "system:kube-scheduler", &[])?;
            let mut sched = Command::new(self.opts.bin_dir.join("kube-scheduler"));
            sched
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg(format!(
                    "--authentication-kubeconfig={}",
                    kubeconfig.display()
                ))
                .arg(format!(
                    "--authorization-kubeconfig={}",
                    kubeconfig.display()
                ))
                .arg(format!("--bind-address={LOOPBACK}"))
                .arg(format!("--secure-port={}", free_port()?))
                .arg("--leader-elect=false");
            self.scheduler = Some(self.spawn("kube-scheduler", sched)?);
        }
        let client = self.client().await?;
        self.wait_for_service_account(&client, "default").await
    }

    fn start_etcd(&mut self) -> Result<()> {
        let client_url = format!("http://{LOOPBACK}:{}", self.etcd_port);
        let peer_url = format!("http://{LOOPBACK}:{}", free_port()?);
        let mut etcd = Command::new(self.opts.bin_dir.join("etcd"));
        etcd.arg("--name=box")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=box={peer_url}"))
            // Throwaway data: no fsync keeps a busy disk from stalling the API server.
            .arg("--unsafe-no-fsync");
        self.etcd = Some(self.spawn("etcd", etcd)?);
        let deadline = Instant::now() + START_TIMEOUT;
        while !etcd_healthy(self.etcd_port) {
            self.check_alive("etcd")?;
            if Instant::now() > deadline {
                bail!(
                    "etcd not healthy after {START_TIMEOUT:?}\n{}",
                    self.log_tail("etcd")
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Starts kube-apiserver (after [`Cluster::stop_apiserver`]) on the same port and
    /// etcd, and waits until `/readyz` says ok.
    pub async fn start_apiserver(&mut self) -> Result<()> {
        if self.apiserver.is_some() {
            bail!("kube-apiserver is already running");
        }
        let pki = self.dir.join("pki");
        let file = |name: &str| pki.join(name).display().to_string();
        let args = [
            format!("--etcd-servers=http://{LOOPBACK}:{}", self.etcd_port),
            format!("--bind-address={LOOPBACK}"),
            format!("--secure-port={}", self.api_port),
            format!("--advertise-address={LOOPBACK}"),
            // The `kubernetes` Service gets no endpoints: a loopback address is not a
            // valid one, and none other may be published from here.
            "--endpoint-reconciler-type=none".into(),
            format!("--cert-dir={}", pki.display()),
            format!("--tls-cert-file={}", file("apiserver.crt")),
            format!("--tls-private-key-file={}", file("apiserver.key")),
            format!("--client-ca-file={}", file("ca.crt")),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", file("sa.pub")),
            format!("--service-account-signing-key-file={}", file("sa.key")),
            format!("--service-cluster-ip-range={}", self.opts.service_cidr),
            "--authorization-mode=RBAC,Node".into(),
            // Kubelets (crate::node) are reached at their node IPs, as the API server's
            // own client (their x509 authentication takes the cluster CA).
            "--kubelet-preferred-address-types=InternalIP".into(),
            format!(
                "--kubelet-client-certificate={}",
                file("kubelet-client.crt")
            ),
            format!("--kubelet-client-key={}", file("kubelet-client.key")),
            format!(
                "--min-request-timeout={}",
                self.opts.min_request_timeout.as_secs().max(1)
            ),
            "--profiling=false".into(),
        ];
        let mut api = Command::new(self.opts.bin_dir.join("kube-apiserver"));
        api.args(args).args(&self.opts.apiserver_args);
        self.apiserver = Some(self.spawn("kube-apiserver", api)?);
        let client = self.client().await?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let req = http::Request::get("/readyz").body(Vec::new())?;
            match client.request_text(req).await {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                _ if Instant::now() > deadline => bail!(
                    "kube-apiserver not ready after {START_TIMEOUT:?}\n{}",
                    self.log_tail("kube-apiserver")
                ),
                _ => {}
            }
            self.check_alive("kube-apiserver")?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops kube-apiserver only (SIGTERM, its graceful shutdown); etcd keeps the data.
    pub fn stop_apiserver(&mut self) {
        if let Some(child) = self.apiserver.take() {
            stop(child);
        }
    }

    /// Stops and starts kube-apiserver, as an upgrade or a crash-loop would.
    pub async fn restart_apiserver(&mut self) -> Result<()> {
        self.stop_apiserver();
        self.start_apiserver().await
    }

    /// Makes the API server reachable at the same address, [`Cluster::server`], inside
    /// the network namespace `netns` (a testbed node's, where an agent run with
    /// `--netns` lives), so the same kubeconfigs work there. Loopback to loopback; stops
    /// when dropped. Needs root (setns).
    pub fn expose_in_netns(&self, netns: &Path) -> Result<NetnsRelay> {
        NetnsRelay::start(netns, self.api_port)
    }

    /// The API server's URL (`https://127.0.0.1:PORT`).
    pub fn server(&self) -> String {
        format!("https://{LOOPBACK}:{}", self.api_port)
    }

    /// A kubeconfig for `system:masters` (client certificate).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The CA that signed the API server's certificate (what a Pod finds in
    /// `/var/run/secrets/kubernetes.io/serviceaccount/ca.crt`).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("pki/ca.crt")
    }

    /// The cluster's folder: certificates, logs, kubeconfigs (removed on drop).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A component's log (`etcd`, `kube-apiserver`, `kube-controller-manager`).
    pub fn log_path(&self, component: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{component}.log"))
    }

    /// An admin client.
    pub async fn client(&self) -> Result<Client> {
        kubeconfig_client(&self.admin_kubeconfig).await
    }

    /// Writes a kubeconfig for a client certificate of `user` in `groups`, signed by the
    /// cluster CA (e.g. `system:node:NAME` in `system:nodes`). The certificate's files are
    /// named after the user: every node's kubelet.kubeconfig has the same file name, and
    /// one shared certificate file made node-0's kubelet, once it reloaded the file, speak
    /// as node-1 (its Node went NotReady mid-run). Returns the certificate's and the key's
    /// paths.
    pub fn write_client_kubeconfig(
        &self,
        path: &Path,
        user: &str,
        groups: &[&str],
    ) -> Result<(PathBuf, PathBuf)> {
        let stem: String = user
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let cert = self.dir.join("pki").join(format!("{stem}.crt"));
        let key = self.dir.join("pki").join(format!("{stem}.key"));
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        for group in groups {
            params
                .distinguished_name
                .push(DnType::OrganizationName, *group);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key_pair = KeyPair::generate()?;
        fs::write(&cert, params.signed_by(&key_pair, &self.ca)?.pem())?;
        write_private(&key, &key_pair.serialize_pem())?;
        let auth = format!(
            "client-certificate: {}\n    client-key: {}",
            cert.display(),
            key.display()
        );
        self.write_kubeconfig(path, user, &auth)?;
        Ok((cert, key))
    }

    /// Mints a token for ServiceAccount `namespace/name` through the TokenRequest API (as
    /// the kubelet does for a Pod's projected volume), valid for an hour, and writes a
    /// kubeconfig for it into the cluster's folder. Returns the kubeconfig's path.
    pub async fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> Result<PathBuf> {
        let token = self.service_account_token(namespace, name).await?;
        let path = self.dir.join(format!("sa-{namespace}-{name}.kubeconfig"));
        let user = format!("system:serviceaccount:{namespace}:{name}");
        self.write_kubeconfig(&path, &user, &format!("token: \"{token}\""))?;
        Ok(path)
    }

    /// A fresh token for ServiceAccount `namespace/name` (TokenRequest API, one hour).
    pub async fn service_account_token(&self, namespace: &str, name: &str) -> Result<String> {
        let sas: Api<ServiceAccount> = Api::namespaced(self.client().await?, namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(), // the API server's own
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = sas
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .with_context(|| format!("TokenRequest for ServiceAccount {namespace}/{name}"))?;
        Ok(answer.status.context("TokenRequest has no status")?.token)
    }

    /// Creates a namespace and waits for its `default` ServiceAccount, without which the
    /// ServiceAccount admission plugin refuses Pods.
    pub async fn create_namespace(&self, name: &str) -> Result<()> {
        let client = self.client().await?;
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        self.wait_for_service_account(&client, name).await
    }

    async fn wait_for_service_account(&self, client: &Client, namespace: &str) -> Result<()> {
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
        let deadline = Instant::now() + START_TIMEOUT;
        while sas.get_opt("default").await?.is_none() {
            if Instant::now() > deadline {
                bail!(
                    "no ServiceAccount {namespace}/default after {START_TIMEOUT:?}\n{}",
                    self.log_tail("kube-controller-manager")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    fn write_kubeconfig(&self, path: &Path, user: &str, auth: &str) -> Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: box\n  cluster:\n    \
             server: {server}\n    certificate-authority: {ca}\nusers:\n- name: \"{user}\"\n  \
             user:\n    {auth}\ncontexts:\n- name: box\n  context:\n    cluster: box\n    \
             user: \"{user}\"\ncurrent-context: box\n",
            server = self.server(),
            ca = self.ca_file().display(),
        );
        write_private(path, &text)
    }

    /// Starts `cmd` as the cluster's other processes are (its log in `logs/NAME.log`,
    /// killed if this process dies).
    pub(crate) fn spawn_logged(&self, name: &str, cmd: Command) -> Result<Child> {
        self.spawn(name, cmd)
    }

    fn spawn(&self, name: &str, mut cmd: Command) -> Result<Child> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(name))?;
        cmd.current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        self.keeper
            .spawn(cmd)
            .with_context(|| format!("starting {name} from {}", self.opts.bin_dir.display()))
    }

    /// Fails, with the end of its log, if `name` has exited.
    fn check_alive(&mut self, name: &str) -> Result<()> {
        let child = match name {
            "etcd" => self.etcd.as_mut(),
            "kube-apiserver" => self.apiserver.as_mut(),
            _ => self.controller_manager.as_mut(),
        };
        if let Some(status) = child.map(|c| c.try_wait()).transpose()?.flatten() {
            bail!("{name} exited: {status}\n{}", self.log_tail(name));
        }
        Ok(())
    }

    /// The last lines of a component's log, for error messages.
    pub fn log_tail(&self, component: &str) -> String {
        let text = fs::read_to_string(self.log_path(component)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!("--- last lines of {component}'s log ---\n{tail}")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in [
            self.scheduler.take(),
            self.controller_manager.take(),
            self.apiserver.take(),
            self.etcd.take(),
        ]
        .into_iter()
        .flatten()
        {
            stop(child);
        }
        if std::env::var_os("PROXY_CLUSTER_KEEP").is_some() {
            eprintln!("cluster: kept {} (PROXY_CLUSTER_KEEP)", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// An admin-less client from any kubeconfig file.
pub async fn kubeconfig_client(path: &Path) -> Result<Client> {
    let kubeconfig =
        Kubeconfig::read_from(path).with_context(|| format!("reading {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading {}", path.display()))?;
    Ok(Client::try_from(config)?)
}

/// A TCP relay from 127.0.0.1:PORT in a network namespace to 127.0.0.1:PORT in this
/// process's (see [`Cluster::expose_in_netns`]). Sockets keep the namespace they were made
/// in: the listener is made by a thread that entered `netns`, the connections onward by
/// one that stayed here.
pub struct NetnsRelay {
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<HashMap<usize, [TcpStream; 2]>>>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl NetnsRelay {
    fn start(netns: &Path, port: u16) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<HashMap<usize, [TcpStream; 2]>>> = Arc::default();
        let (accepted_tx, accepted_rx) = mpsc::channel::<TcpStream>();
        // Dials out from this namespace. A connection is forgotten once both directions
        // ended; the relay's drop shuts down those still open.
        let dialer = {
            let conns = conns.clone();
            thread::Builder::new()
                .name("relay-dial".into())
                .spawn(move || {
                    for (id, inside) in accepted_rx.into_iter().enumerate() {
                        let Ok(outside) = TcpStream::connect((LOOPBACK, port)) else {
                            continue; // the API server is down (a restart): refused
                        };
                        let ends = Arc::new(AtomicU32::new(0));
                        for (from, to) in [(&inside, &outside), (&outside, &inside)] {
                            let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone())
                            else {
                                continue;
                            };
                            let (ends, conns) = (ends.clone(), conns.clone());
                            thread::spawn(move || {
                                let _ = std::io::copy(&mut from, &mut to);
                                let _ = to.shutdown(std::net::Shutdown::Write);
                                if ends.fetch_add(1, Ordering::Relaxed) == 1 {
                                    lock(&conns).remove(&id);
                                }
                            });
                        }
                        lock(&conns).insert(id, [inside, outside]);
                    }
                })?
        };
        // Listens inside `netns`.
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let acceptor = {
            let (stop, netns) = (stop.clone(), netns.to_path_buf());
            thread::Builder::new()
                .name("relay-accept".into())
                .spawn(move || {
                    let listener = proxy_testbed::client::enter(Some(&netns), None)
                        .and_then(|()| Ok(TcpListener::bind((LOOPBACK, port))?))
                        .and_then(|l| l.set_nonblocking(true).map(|()| l).map_err(Into::into));
                    let listener = match listener {
                        Ok(l) => {
                            let _ = ready_tx.send(Ok(()));
                            l
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    while !stop.load(Ordering::Relaxed) {
                        match listener.accept() {
                            Ok((conn, _)) => {
                                let _ = conn.set_nonblocking(false);
                                if accepted_tx.send(conn).is_err() {
                                    return;
                                }
                            }
                            Err(_) => thread::sleep(Duration::from_millis(20)),
                        }
                    }
                })?
        };
        let relay = NetnsRelay {
            stop,
            conns,
            threads: vec![acceptor, dialer],
        };
        ready_rx
            .recv()
            .context("relay thread gone")?
            .with_context(|| format!("listening on {LOOPBACK}:{port} in {}", netns.display()))?;
        Ok(relay)
    }
}

impl Drop for NetnsRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for conn in lock(&self.conns).drain().flat_map(|(_, pair)| pair) {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        // The acceptor ends on the flag, then the dialer when the acceptor's sender goes.
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Spawns the cluster's processes from one thread that lives exactly as long as the
/// cluster, each with `PR_SET_PDEATHSIG`: the kernel kills them if this process dies
/// without running `Drop` (SIGKILL, abort). The signal follows the spawning *thread*, so
/// spawning from a test thread or a tokio worker could kill them early.
struct Keeper {
    tx: Option<mpsc::Sender<(Command, mpsc::Sender<std::io::Result<Child>>)>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Keeper {
    fn new() -> Result<Self> {
        let (tx, rx) = mpsc::channel::<(Command, mpsc::Sender<std::io::Result<Child>>)>();
        let thread = thread::Builder::new()
            .name("cluster-keeper".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })?;
        Ok(Keeper {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    fn spawn(&self, mut cmd: Command) -> Result<Child> {
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        self.tx
            .as_ref()
            .context("keeper stopped")?
            .send((cmd, reply_tx))
            .ok()
            .context("keeper thread gone")?;
        Ok(reply_rx.recv().context("keeper thread gone")??)
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// SIGTERM, then SIGKILL after [`STOP_GRACE`]; reaps the process.
/// SIGTERM, then SIGKILL after the grace period.
pub(crate) fn stop_child(child: Child) {
    stop(child)
}

fn stop(mut child: Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill has no memory-safety preconditions; the child is not reaped yet,
        // so the pid is still ours.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A port free on loopback now (the kernel's choice; released before the component binds).
/// A free port outside the kernel's ephemeral range: a port the kernel hands out can be
/// taken by any outgoing connection between our choosing it and the server binding it
/// (seen: kube-apiserver "address already in use" while other tests ran).
fn free_port() -> Result<u16> {
    let (low, high) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|n| n.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    // Above the range if there is room, else below it (but above the well-known ports).
    let (from, to) = if high < 65000 {
        (high + 1, 65535)
    } else {
        (10000, low.saturating_sub(1).max(10001))
    };
    let span = u32::from(to - from) + 1;
    let seed = std::process::id() ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(16);
    for i in 0..200u32 {
        let port = from + ((seed.wrapping_mul(2_654_435_761).wrapping_add(i * 7919)) % span) as u16;
        if TcpListener::bind((LOOPBACK, port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind((LOOPBACK, 0))?.local_addr()?.port())
}

fn etcd_healthy(port: u16) -> bool {
    let addr = SocketAddr::from((LOOPBACK, port));
    let Ok(mut conn) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let mut body = String::new();
    conn.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .and_then(|()| conn.read_to_string(&mut body))
        .is_ok()
        && body.contains("\"health\":\"true\"")
}

/// Writes the CA, the API server's serving certificate and the ServiceAccount signing key
/// into `pki`; returns the CA, which signs client certificates later.
fn write_pki(pki: &Path, service_cidr: &str) -> Result<Issuer<'static, KeyPair>> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "proxy-cluster-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate()?;
    fs::write(pki.join("ca.crt"), ca_params.self_signed(&ca_key)?.pem())?;
    let ca = Issuer::new(ca_params, ca_key);

    // The names a client may reach the API server by: loopback, and the in-cluster names
    // and first ClusterIP of the `kubernetes` Service.
    let mut params = CertificateParams::new(vec![
        "localhost".to_string(),
        "kubernetes".into(),
        "kubernetes.default".into(),
        "kubernetes.default.svc".into(),
        "kubernetes.default.svc.cluster.local".into(),
    ])?;
    params
        .subject_alt_names
        .push(SanType::IpAddress(LOOPBACK.into()));
    if let Some(ip) = first_service_ip(service_cidr) {
        params.subject_alt_names.push(SanType::IpAddress(ip.into()));
    }
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate()?;
    fs::write(
        pki.join("apiserver.crt"),
        params.signed_by(&key, &ca)?.pem(),
    )?;
    write_private(&pki.join("apiserver.key"), &key.serialize_pem())?;

    // The API server's client certificate towards kubelets (logs, exec, port-forward).
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver-kubelet-client");
    params
        .distinguished_name
        .push(DnType::OrganizationName, "kubeadm:cluster-admins");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate()?;
    fs::write(
        pki.join("kubelet-client.crt"),
        params.signed_by(&key, &ca)?.pem(),
    )?;
    write_private(&pki.join("kubelet-client.key"), &key.serialize_pem())?;

    let sa = KeyPair::generate()?;
    write_private(&pki.join("sa.key"), &sa.serialize_pem())?;
    fs::write(pki.join("sa.pub"), sa.public_key_pem())?;
    Ok(ca)
}

/// The `kubernetes` Service's ClusterIP: the range's first address after the network.
fn first_service_ip(cidr: &str) -> Option<Ipv4Addr> {
    let network: Ipv4Addr = cidr.split('/').next()?.parse().ok()?;
    Some(Ipv4Addr::from(u32::from(network) + 1))
}

/// Keys and tokens: readable by their owner only.
fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file: File = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

/// Polls `f` until it yields a value, for at most 60 s.
pub async fn eventually<T, F, Fut>(what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = f().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::first_service_ip;

    #[test]
    fn kubernetes_service_ip_is_the_ranges_first() {
        assert_eq!(
            first_service_ip("10.96.0.0/16"),
            Some("10.96.0.1".parse().unwrap())
        );
        assert_eq!(first_service_ip("fd96::/108"), None);
    }
}
