//! Who may read what over the feed's mutual TLS (on loopback): a node's certificate
//! (kubelet's: CN `system:node:<name>`, O `system:nodes`) reads its own view; one that
//! names the node otherwise (a SAN, a CN outside the group), another node's certificate
//! asking for it, and a client without a certificate, get nothing; a CA rotated on disk
//! is taken by the running server for new connections, without a restart.

use std::{path::Path, sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::Service;
use proxy_agent::{
    feed::server::{Cut, Hub, HubOptions, grpc},
    feed::{
        tls::{Reloading, TlsFiles},
        wire::v1,
    },
    source::Snapshot,
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

struct Ca(Issuer<'static, KeyPair>, String);

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    let pem = p.self_signed(&key).expect("ca").pem();
    Ca(Issuer::new(p, key), pem)
}

/// A certificate and key signed by `ca`: a server's (SAN 127.0.0.1) or a client's as
/// kubelet's is made (CN, O=system:nodes).
fn leaf(ca: &Ca, cn: &str, server: bool) -> (String, String) {
    let (sans, groups) = if server {
        (vec!["127.0.0.1".to_string()], vec![])
    } else {
        (Vec::new(), vec!["system:nodes"])
    };
    client_cert(ca, Some(cn), &groups, sans, server)
}

/// A certificate and key signed by `ca` with this subject (CN, O's) and these DNS SANs.
fn client_cert(
    ca: &Ca,
    cn: Option<&str>,
    groups: &[&str],
    sans: Vec<String>,
    server: bool,
) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(sans).expect("params");
    if let Some(cn) = cn {
        p.distinguished_name.push(DnType::CommonName, cn);
    }
    for group in groups {
        p.distinguished_name.push(DnType::OrganizationName, *group);
    }
    p.extended_key_usages = vec![if server {
        ExtendedKeyUsagePurpose::ServerAuth
    } else {
        ExtendedKeyUsagePurpose::ClientAuth
    }];
    (
        p.signed_by(&key, &ca.0).expect("signed").pem(),
        key.serialize_pem(),
    )
}

fn write_server_files(dir: &Path, ca: &Ca) -> TlsFiles {
    let (cert, key) = leaf(ca, "proxy-agent-serve", true);
    let files = TlsFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
        ca: dir.join("ca.crt"),
    };
    std::fs::write(&files.cert, cert).expect("write");
    std::fs::write(&files.key, key).expect("write");
    std::fs::write(&files.ca, &ca.1).expect("write");
    files
}

async fn server(dir: &Path, ca: &Ca) -> (String, TlsFiles) {
    let (addr, files, _) = server_hub(dir, ca).await;
    (addr, files)
}

async fn server_hub(dir: &Path, ca: &Ca) -> (String, TlsFiles, Arc<Hub>) {
    let files = write_server_files(dir, ca);
    let hub = Hub::new(HubOptions::default());
    let mut snap = Snapshot::default();
    let svc: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}
    }))
    .expect("service");
    snap.model.add_service(&svc);
    hub.publish(&snap);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let tls = Arc::new(Reloading::new(files.clone()).expect("tls"));
    let feed = grpc::Feed::new(Arc::clone(&hub), grpc::Identity::ClientCertificate);
    tokio::spawn(grpc::serve(listener, feed, Some(tls)));
    (addr, files, hub)
}

/// The first batch `node` is given, asking as the holder of `identity`.
async fn first_batch(
    addr: &str,
    ca_pem: &str,
    identity: Option<&(String, String)>,
    node: &str,
) -> Result<v1::Batch, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("127.0.0.1");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let ch = Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut client = v1::node_feed_client::NodeFeedClient::new(ch);
    let req = v1::WatchRequest {
        node_name: node.into(),
        ..Default::default()
    };
    let mut stream = client
        .watch(req)
        .await
        .map_err(|s| format!("{:?}", s.code()))?
        .into_inner();
    tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .map_err(|_| "no batch".to_string())?
        .map_err(|s| format!("{:?}", s.code()))?
        .ok_or_else(|| "ended".to_string())
}

#[tokio::test]
async fn a_node_reads_only_its_own_view() {
    let dir = tempdir();
    let ca1 = ca("feed-ca");
    let (addr, files) = server(&dir, &ca1).await;
    let node_a = leaf(&ca1, "system:node:node-a", false);
    let node_b = leaf(&ca1, "system:node:node-b", false);
    let batch = first_batch(&addr, &ca1.1, Some(&node_a), "node-a")
        .await
        .expect("node A reads its view");
    assert!(batch.snapshot && batch.ops.len() == 1, "{batch:?}");

    let denied = first_batch(&addr, &ca1.1, Some(&node_b), "node-a").await;
    assert_eq!(denied.err().as_deref(), Some("PermissionDenied"));
    let nameless = leaf(&ca1, "somebody", false);
    let denied = first_batch(&addr, &ca1.1, Some(&nameless), "node-a").await;
    assert_eq!(denied.err().as_deref(), Some("PermissionDenied"));
    let anonymous = first_batch(&addr, &ca1.1, None, "node-a").await;
    assert!(anonymous.is_err(), "no certificate, yet {anonymous:?}");
    let other_ca = ca("another-ca");
    let forged = leaf(&other_ca, "system:node:node-a", false);
    let forged = first_batch(&addr, &ca1.1, Some(&forged), "node-a").await;
    assert!(forged.is_err(), "another CA's certificate, yet {forged:?}");

    // Rotation: a new CA and server certificate on disk; the running server takes them.
    std::thread::sleep(Duration::from_millis(20));
    let ca2 = ca("feed-ca-2");
    write_server_files(&dir, &ca2);
    let _ = files;
    let new_a = leaf(&ca2, "system:node:node-a", false);
    first_batch(&addr, &ca2.1, Some(&new_a), "node-a")
        .await
        .expect("the rotated CA's node A");
    let old = first_batch(&addr, &ca1.1, Some(&node_a), "node-a").await;
    assert!(old.is_err(), "the old CA still accepted: {old:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The node's name comes from the certificate's CN in O=system:nodes only, as the API
/// server reads a kubelet's: a SAN `system:node:node-b` (without that CN) was accepted
/// as node-b; so was a CN outside the nodes' group.
#[tokio::test]
async fn only_a_kubelets_subject_names_a_node() {
    let dir = tempdir();
    let ca = ca("feed-ca");
    let (addr, _files) = server(&dir, &ca).await;
    let san_only = client_cert(
        &ca,
        Some("somebody"),
        &["system:nodes"],
        vec!["system:node:node-b".into()],
        false,
    );
    let no_cn = client_cert(
        &ca,
        None,
        &["system:nodes"],
        vec!["system:node:node-b".into()],
        false,
    );
    let no_group = client_cert(&ca, Some("system:node:node-b"), &[], Vec::new(), false);
    let other_group = client_cert(
        &ca,
        Some("system:node:node-b"),
        &["system:masters"],
        Vec::new(),
        false,
    );
    for (what, cert) in [
        ("a SAN with another CN", &san_only),
        ("a SAN and no CN", &no_cn),
        ("a CN without an O", &no_group),
        ("a CN in another group", &other_group),
    ] {
        let got = first_batch(&addr, &ca.1, Some(cert), "node-b").await;
        assert_eq!(
            got.as_ref().err().map(String::as_str),
            Some("PermissionDenied"),
            "{what}: {got:?}"
        );
    }
    // The kubelet's own shape reads the same view (rcgen writes one O per subject).
    let kubelet = leaf(&ca, "system:node:node-b", false);
    first_batch(&addr, &ca.1, Some(&kubelet), "node-b")
        .await
        .expect("the kubelet's certificate reads node-b");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 42: ~1,000 idle connections from one peer that never start a handshake held the
/// server's 1,024 file descriptors for the handshake timeout (10 s). Now a peer address
/// may have `HANDSHAKES_PER_PEER` handshakes under way (more are closed at once), each
/// gets `HANDSHAKE_TIMEOUT` (3 s), and a node elsewhere reads its view meanwhile.
#[tokio::test]
async fn idle_connections_from_one_peer_are_bounded_and_closed_soon() {
    use tokio::io::AsyncReadExt as _;
    let dir = tempdir();
    let ca1 = ca("feed-ca");
    let (addr, _files, hub) = server_hub(&dir, &ca1).await;
    let target: std::net::SocketAddr = addr.parse().expect("addr");
    // The idle peer: another loopback address, 200 connections that never say a word.
    let mut idle = Vec::new();
    for _ in 0..200 {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind("127.0.0.2:0".parse().expect("addr"))
            .expect("bind 127.0.0.2");
        idle.push(sock.connect(target).await.expect("connect"));
    }
    let node_a = leaf(&ca1, "system:node:node-a", false);
    let started = std::time::Instant::now();
    let batch = first_batch(&addr, &ca1.1, Some(&node_a), "node-a")
        .await
        .expect("node A reads its view beside the idle peer");
    assert!(batch.snapshot, "{batch:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "node A waited {:?}",
        started.elapsed()
    );
    // Every idle connection is closed by the server within the handshake timeout: the
    // ones past the bound at once, the others when their handshake times out.
    let deadline = tokio::time::Instant::now() + grpc::HANDSHAKE_TIMEOUT + Duration::from_secs(2);
    for (i, conn) in idle.iter_mut().enumerate() {
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout_at(deadline, conn.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "idle connection {i} still open {:?} after it was made: {read:?}",
            started.elapsed()
        );
    }
    let cuts = hub.counts().cuts;
    assert_eq!(
        cuts.get(Cut::HandshakesPerPeer),
        200 - grpc::HANDSHAKES_PER_PEER as u64,
        "{cuts:?}"
    );
    assert_eq!(
        cuts.get(Cut::HandshakeTimeout),
        grpc::HANDSHAKES_PER_PEER as u64,
        "{cuts:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "feed-auth-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}
