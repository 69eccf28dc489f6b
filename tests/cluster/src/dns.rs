//! A stand-in for cluster DNS in the box: the e2e specs reach Services by name
//! (`nc affinity-clusterip 80`), and the box has no CoreDNS. It answers A queries for
//! `SERVICE.NAMESPACE.svc.cluster.local` with the Service's ClusterIP (an ExternalName
//! Service: a CNAME to its name, followed when that is one of ours), read from the API
//! server every 500 ms; anything else gets NXDOMAIN (AAAA of a known name: no records).
//! It listens on the box network's root-namespace address, which the kubelets give Pods
//! as their nameserver (`clusterDNS`). Not CoreDNS: no headless records, no SRV, no PTR.

use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Service;
use kube::{Api, Client, api::ListParams};

const SUFFIX: &str = ".svc.cluster.local";

/// The running server; stops when dropped.
pub struct Dns {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
    refresher: tokio::task::JoinHandle<()>,
}

impl Dns {
    /// Serves on `addr:53` (UDP), with Services from `client`.
    pub fn start(addr: Ipv4Addr, client: Client) -> Result<Self> {
        let socket = UdpSocket::bind(SocketAddr::from((addr, 53)))
            .with_context(|| format!("binding {addr}:53 for the box's DNS"))?;
        socket.set_read_timeout(Some(Duration::from_millis(200)))?;
        let names: Arc<Mutex<HashMap<String, Record>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let refresher = {
            let names = names.clone();
            tokio::spawn(async move {
                let api: Api<Service> = Api::all(client);
                loop {
                    if let Ok(list) = api.list(&ListParams::default()).await {
                        let fresh: HashMap<String, Record> = list
                            .items
                            .iter()
                            .filter_map(|s| {
                                let spec = s.spec.as_ref()?;
                                let record = match spec.external_name.as_ref() {
                                    Some(target)
                                        if spec.type_.as_deref() == Some("ExternalName") =>
                                    {
                                        Record::Cname(target.trim_end_matches('.').to_lowercase())
                                    }
                                    _ => Record::A(spec.cluster_ip.as_ref()?.parse().ok()?),
                                };
                                let name = format!(
                                    "{}.{}{SUFFIX}",
                                    s.metadata.name.as_ref()?,
                                    s.metadata.namespace.as_ref()?
                                );
                                Some((name, record))
                            })
                            .collect();
                        *names.lock().unwrap_or_else(|e| e.into_inner()) = fresh;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
        };
        let server = {
            let stop = stop.clone();
            thread::Builder::new()
                .name("box-dns".into())
                .spawn(move || {
                    let mut buf = [0u8; 512];
                    while !stop.load(Ordering::Relaxed) {
                        let Ok((len, from)) = socket.recv_from(&mut buf) else {
                            continue;
                        };
                        let names = names.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        if let Some(answer) = answer(&buf[..len], &names) {
                            let _ = socket.send_to(&answer, from);
                        }
                    }
                })?
        };
        Ok(Dns {
            stop,
            threads: vec![server],
            refresher,
        })
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.refresher.abort();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// What a name resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Record {
    A(Ipv4Addr),
    Cname(String),
}

/// The reply to one query (RFC 1035 §4.1), or None for what is not a query.
fn answer(query: &[u8], names: &HashMap<String, Record>) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 || u16::from_be_bytes([query[4], query[5]]) != 1 {
        return None;
    }
    // The question: labels up to the root, then type and class.
    let mut pos = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(pos)? as usize;
        pos += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None; // compression in a question: not from a resolver
        }
        labels.push(String::from_utf8_lossy(query.get(pos..pos + len)?).to_lowercase());
        pos += len;
    }
    let qtype = u16::from_be_bytes([*query.get(pos)?, *query.get(pos + 1)?]);
    let question_end = pos + 4;
    if question_end > query.len() {
        return None;
    }
    let name = labels.join(".");
    let record = names.get(&name);
    // The answers: a CNAME (ExternalName), then the A it leads to if it is one of ours.
    let mut records: Vec<(u16, Vec<u8>)> = Vec::new();
    match record {
        Some(Record::Cname(target)) => {
            let mut wire = Vec::new();
            for label in target.split('.').filter(|l| !l.is_empty()) {
                wire.push(u8::try_from(label.len()).ok()?);
                wire.extend_from_slice(label.as_bytes());
            }
            wire.push(0);
            records.push((5, wire));
            if let (Some(Record::A(ip)), 1) = (names.get(target), qtype) {
                records.push((1, ip.octets().to_vec()));
            }
        }
        Some(Record::A(ip)) if qtype == 1 => records.push((1, ip.octets().to_vec())),
        _ => {}
    }
    let mut reply = Vec::with_capacity(question_end + 64);
    reply.extend_from_slice(&query[..2]); // id
    let rcode = if record.is_some() { 0 } else { 3 }; // NOERROR / NXDOMAIN
    // QR, the query's opcode and RD, AA; RA; rcode.
    reply.push(0x84 | (query[2] & 0x79));
    reply.push(0x80 | rcode);
    reply.extend_from_slice(&1u16.to_be_bytes());
    reply.extend_from_slice(&u16::try_from(records.len()).ok()?.to_be_bytes());
    reply.extend_from_slice(&[0, 0, 0, 0]);
    reply.extend_from_slice(&query[12..question_end]);
    let mut owner = vec![0xc0, 12]; // the question's name
    for (rtype, data) in records {
        let at = reply.len();
        reply.extend_from_slice(&owner);
        reply.extend_from_slice(&rtype.to_be_bytes());
        reply.extend_from_slice(&[0, 1]); // IN
        reply.extend_from_slice(&5u32.to_be_bytes()); // TTL
        reply.extend_from_slice(&u16::try_from(data.len()).ok()?.to_be_bytes());
        reply.extend_from_slice(&data);
        // The A after a CNAME is owned by the CNAME's target (its rdata, just written).
        let rdata = at + owner.len() + 10;
        owner = vec![0xc0 | (rdata >> 8) as u8, rdata as u8];
    }
    Some(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        q
    }

    #[test]
    fn answers_a_service_and_refuses_the_rest() {
        let names = HashMap::from([
            (
                "web.ns.svc.cluster.local".to_string(),
                Record::A(Ipv4Addr::new(10, 96, 0, 7)),
            ),
            (
                "ext.ns.svc.cluster.local".to_string(),
                Record::Cname("web.ns.svc.cluster.local".into()),
            ),
        ]);
        let a = answer(&query("web.ns.svc.cluster.local", 1), &names).unwrap();
        assert_eq!(&a[..2], &[0x12, 0x34]);
        assert_eq!(a[3] & 0x0f, 0, "NOERROR");
        assert_eq!(u16::from_be_bytes([a[6], a[7]]), 1, "one answer");
        assert_eq!(&a[a.len() - 4..], &[10, 96, 0, 7]);
        let aaaa = answer(&query("web.ns.svc.cluster.local", 28), &names).unwrap();
        assert_eq!(
            (aaaa[3] & 0x0f, u16::from_be_bytes([aaaa[6], aaaa[7]])),
            (0, 0)
        );
        let other = answer(&query("web.other.svc.cluster.local", 1), &names).unwrap();
        assert_eq!(other[3] & 0x0f, 3, "NXDOMAIN");
        assert!(answer(&[0; 5], &names).is_none());
        let cname = answer(&query("ext.ns.svc.cluster.local", 1), &names).unwrap();
        assert_eq!(u16::from_be_bytes([cname[6], cname[7]]), 2, "CNAME and A");
        assert_eq!(&cname[cname.len() - 4..], &[10, 96, 0, 7]);
    }
}
