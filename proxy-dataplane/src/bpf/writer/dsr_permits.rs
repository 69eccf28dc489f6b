//! Direct server return's permits (`DSR_PERMITS`): a backend's node believes an option
//! (IPv6: a Destination Options header) only for a frontend of a Service in `dsr` mode
//! and a backend of it, as this agent programmed them — never for what a packet claims
//! on its own (ABI.md, `DSR_PERMITS`).
//!
//! One key per (frontend, backend); the NodePort frontends of a Service port share theirs
//! (their address is any node's, all zero), so keys are counted by the frontends that
//! want them and deleted at zero.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::error::{ErrorKind, Kind as _, Result};
use proxy_common::{DSR_ANY_NODE, DsrPermitKey, addr::to_words};

use crate::bpf::{codec::proto_number, maps::MapSet, maps::remove_ignoring_absent};
use proxy_model::{Frontend, FrontendKind, FrontendState, NodeView};

#[derive(Debug, Default)]
pub struct DsrPermits {
    /// The keys each frontend in `dsr` mode has written.
    by_frontend: HashMap<Frontend, Box<[DsrPermitKey]>>,
    /// How many frontends want each key.
    refs: HashMap<DsrPermitKey, u32>,
    /// Keys found in the map at adoption that no frontend has claimed yet: the next
    /// full apply deletes those still unclaimed.
    adopted: HashSet<DsrPermitKey>,
}

impl DsrPermits {
    /// What an earlier run left in the map.
    pub fn adopt(maps: &MapSet) -> Result<Self> {
        let adopted = maps
            .dsr_permits
            .keys()
            .collect::<Result<_, _>>()
            .kind(ErrorKind::Map, "reading DSR_PERMITS")?;
        Ok(Self {
            adopted,
            ..Default::default()
        })
    }

    /// Brings the map to `view` (all of it, or the `changed` frontends). New keys are
    /// written before old ones go, so a backend that stays never loses its permit.
    pub fn sync(
        &mut self,
        maps: &mut MapSet,
        view: &NodeView,
        changed: Option<&BTreeSet<Frontend>>,
    ) -> Result<()> {
        let frontends: Vec<Frontend> = match changed {
            Some(changed) => changed.iter().copied().collect(),
            // Every frontend that has or had permits (the others have none to change).
            None => view
                .iter()
                .filter(|(_, st)| st.dsr)
                .map(|(fe, _)| *fe)
                .chain(self.by_frontend.keys().copied())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        };
        for fe in frontends {
            let wanted = view.get(&fe).map(|st| wanted(&fe, st)).unwrap_or_default();
            let old = self.by_frontend.get(&fe).cloned().unwrap_or_default();
            if *old == *wanted {
                continue;
            }
            for key in wanted.iter().filter(|k| !old.contains(k)) {
                let refs = self.refs.entry(*key).or_default();
                if *refs == 0 && !self.adopted.remove(key) {
                    maps.dsr_permits
                        .insert(key, &1, 0)
                        .kind_with(ErrorKind::Map, || format!("writing DSR_PERMITS for {fe}"))?;
                }
                *refs += 1;
            }
            for key in old.iter().filter(|k| !wanted.contains(k)) {
                self.release(maps, key)?;
            }
            if wanted.is_empty() {
                self.by_frontend.remove(&fe);
            } else {
                self.by_frontend.insert(fe, wanted.into_boxed_slice());
            }
        }
        if changed.is_none() {
            for key in std::mem::take(&mut self.adopted) {
                remove_ignoring_absent(maps.dsr_permits.remove(&key))?;
            }
        }
        Ok(())
    }

    fn release(&mut self, maps: &mut MapSet, key: &DsrPermitKey) -> Result<()> {
        let Some(refs) = self.refs.get_mut(key) else {
            return Ok(());
        };
        *refs -= 1;
        if *refs == 0 {
            self.refs.remove(key);
            remove_ignoring_absent(maps.dsr_permits.remove(key))?;
        }
        Ok(())
    }
}

/// The keys a frontend wants: one per backend of its external set, when it is in `dsr`
/// mode (only outside clients take direct server return).
fn wanted(fe: &Frontend, st: &FrontendState) -> Vec<DsrPermitKey> {
    if !st.dsr {
        return Vec::new();
    }
    let (frontend, family) = to_words(fe.ip);
    let frontend = if st.kind == FrontendKind::NodePort {
        DSR_ANY_NODE
    } else {
        frontend
    };
    let mut keys: Vec<DsrPermitKey> = st
        .backends
        .endpoints
        .iter()
        .filter(|be| be.is_ipv4() == fe.ip.is_ipv4())
        .map(|be| DsrPermitKey {
            frontend,
            backend: to_words(be.ip()).0,
            frontend_port: fe.port.to_be(),
            backend_port: be.port().to_be(),
            proto: proto_number(fe.protocol),
            family,
            _pad: [0; 2],
        })
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_model::Protocol;

    fn state(kind: FrontendKind, backends: &[&str], dsr: bool) -> FrontendState {
        FrontendState::builder("web/x:http", kind)
            .backends(backends.iter().map(|b| b.parse().expect("socket address")))
            .dsr(dsr)
            .build()
    }

    fn fe(ip: &str, port: u16) -> Frontend {
        Frontend {
            ip: ip.parse().expect("ip"),
            port,
            protocol: Protocol::Tcp,
        }
    }

    #[test]
    fn only_dsr_frontends_want_permits_and_node_ports_name_any_node() {
        let backends = ["10.244.2.7:8080", "10.244.1.5:8080"];
        let node_port = state(FrontendKind::NodePort, &backends, true);
        let keys = wanted(&fe("192.0.2.10", 30080), &node_port);
        assert_eq!(keys.len(), 2);
        assert!(keys.iter().all(|k| k.frontend == DSR_ANY_NODE));
        assert!(keys.iter().all(|k| k.frontend_port == 30080u16.to_be()));

        let lb = state(FrontendKind::LoadBalancer, &backends, true);
        let keys = wanted(&fe("203.0.113.7", 80), &lb);
        assert_eq!(
            keys[0].frontend,
            to_words("203.0.113.7".parse().expect("ip")).0
        );

        let snat = state(FrontendKind::NodePort, &backends, false);
        assert!(wanted(&fe("192.0.2.10", 30080), &snat).is_empty());
    }
}
