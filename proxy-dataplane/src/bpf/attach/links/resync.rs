//! What each resync checks of the classifier's links (`Classifiers::check`): every
//! served interface still runs our programs on both hooks — a pin deleted by hand, a link
//! detached, a filter deleted: attached again, logged and counted — and what else sits
//! there is judged (a classifier named as ours from another pin folder whose agent is
//! gone is detached or adopted; one whose agent runs is left and reported).

use super::*;
use crate::error::{ErrorKind, fail};

impl Classifiers {
    /// The periodic check of every interface served, and of those whose attachment
    /// failed: our programs run on both hooks (re-attached where they do not), and what
    /// else is there is looked at.
    pub fn check(&mut self) {
        let served: Vec<(String, u32)> = self
            .attached
            .iter()
            .map(|(name, index)| (name.clone(), *index))
            .collect();
        for (name, index) in &served {
            self.repair(name, *index);
        }
        let failed: Vec<Device> = self.failed.values().cloned().collect();
        for link in &failed {
            self.attach_logged(link);
        }
        let all = served
            .into_iter()
            .chain(failed.into_iter().map(|l| (l.name, l.index)));
        for (name, index) in all.collect::<Vec<_>>() {
            self.inspect_hooks(&name, index);
        }
    }

    /// Attaches again whichever of our programs no longer runs on `name`'s hooks.
    pub(super) fn repair(&mut self, name: &str, index: u32) {
        for (program, hook, prefix) in HOOKS {
            let Some(why) = self.lost(name, index, program, hook, prefix) else {
                continue;
            };
            match self.attach_one(name, index, program, hook, prefix) {
                Ok(how) => {
                    self.hooks.count_repaired();
                    tracing::warn!(
                        interface = name,
                        program,
                        why,
                        how,
                        "classifier hook was lost; attached again"
                    );
                }
                Err(e) => {
                    self.failures.count();
                    tracing::warn!(
                        interface = name,
                        program,
                        why,
                        error = format!("{e:#}"),
                        "classifier hook was lost and is not attached again"
                    );
                }
            }
        }
    }

    /// Why `program` no longer runs on `name`'s `hook`, if it does not.
    pub(super) fn lost(
        &self,
        name: &str,
        index: u32,
        program: &str,
        hook: TcAttachType,
        prefix: &str,
    ) -> Option<&'static str> {
        let id = self.ids.get(program).copied();
        match self.hook {
            TcHook::Tcx => {
                let pin = pin_path(&self.links_dir, prefix, name);
                if !pin.exists() {
                    return Some("its pinned link is gone");
                }
                match link_update::pinned_field(&pin, "ifindex") {
                    Ok(i) if i == u64::from(index) => {}
                    Ok(0) => return Some("its link is detached"),
                    Ok(_) => return Some("its link is on another device"),
                    Err(_) => return Some("its pin is not a readable link"),
                }
                match SchedClassifier::query_tcx(index, hook) {
                    Ok((_, progs)) if !progs.iter().any(|p| Some(p.id()) == id) => {
                        Some("the hook runs another program")
                    }
                    _ => None,
                }
            }
            TcHook::Clsact => match clsact::at_our_place(index, hook) {
                Ok(Some(f)) if f.id.is_some() && f.id == id => None,
                Ok(Some(_)) => Some("our place on the hook holds another filter"),
                Ok(None) => Some("its filter is gone"),
                // The device went meanwhile: its link change says so.
                Err(_) => None,
            },
        }
    }

    /// Looks at every classifier named as ours on `name`'s hooks that is not ours:
    /// takes off those of gone agents, reports the others.
    pub(super) fn inspect_hooks(&mut self, name: &str, index: u32) {
        let mut found = Vec::new();
        for (program, hook, _) in HOOKS {
            let ours = self.ids.get(program).copied();
            if self.tcx {
                match SchedClassifier::query_tcx(index, hook) {
                    Ok((_, progs)) => {
                        let our_place = progs.iter().position(|p| Some(p.id()) == ours);
                        for (place, p) in progs.iter().enumerate() {
                            let Some(pname) = p
                                .name_as_str()
                                .and_then(|n| CLASSIFIER_NAMES.iter().find(|c| **c == n))
                            else {
                                continue;
                            };
                            if self.ids.values().any(|id| *id == p.id()) {
                                continue;
                            }
                            let maps = p.map_ids().ok().flatten().unwrap_or_default();
                            let owner = self.ownership.owner(p.id(), &maps);
                            let shadows = our_place.is_none_or(|o| place < o);
                            let foreign = ForeignClassifier {
                                interface: name.to_string(),
                                hook: clsact::hook_name(hook),
                                attach: "tcx",
                                program: (*pname).to_string(),
                                program_id: p.id(),
                                pin_dir: None,
                                agent_running: false,
                                shadows_ours: shadows,
                            };
                            found.extend(self.judge(foreign, owner, index, hook));
                        }
                    }
                    // Reading another agent's programs takes CAP_SYS_ADMIN
                    // (BPF_PROG_GET_FD_BY_ID): without it this check cannot see them.
                    Err(e) if !self.said_unreadable => {
                        self.said_unreadable = true;
                        tracing::warn!(
                            interface = name,
                            error = %e,
                            "tcx hook unreadable: other agents' classifiers cannot be found"
                        );
                    }
                    Err(_) => {}
                }
            }
            match clsact::filters(index, hook) {
                Ok(filters) => {
                    let ours_there = filters
                        .iter()
                        .any(|f| f.at_our_place() && f.id.is_some() && f.id == ours);
                    for f in filters {
                        let (Some(id), Some(pname)) = (f.id, f.name.as_deref()) else {
                            continue;
                        };
                        let Some(pname) = CLASSIFIER_NAMES.iter().find(|c| **c == pname) else {
                            continue;
                        };
                        if f.kind != "bpf" || self.ids.values().any(|i| *i == id) {
                            continue;
                        }
                        let owner = self.ownership.owner_of_program(id);
                        // tcx runs before any filter; among filters, the lower place first.
                        let shadows = self.hook == TcHook::Clsact
                            && (!ours_there
                                || (f.priority, f.handle) < (clsact::PRIORITY, clsact::HANDLE));
                        let foreign = ForeignClassifier {
                            interface: name.to_string(),
                            hook: clsact::hook_name(hook),
                            attach: "clsact",
                            program: (*pname).to_string(),
                            program_id: id,
                            pin_dir: None,
                            agent_running: false,
                            shadows_ours: shadows,
                        };
                        // Only a filter at our place can be taken over (the audit knows
                        // no other place of ours).
                        let owner = match owner {
                            Owner::Stale(folder) if !f.at_our_place() => Owner::Live(folder),
                            owner => owner,
                        };
                        found.extend(self.judge(foreign, owner, index, hook));
                    }
                }
                Err(e) => tracing::debug!(
                    interface = name,
                    error = format!("{e:#}"),
                    "clsact filters unreadable"
                ),
            }
        }
        self.set_foreign(name, found);
    }

    /// Takes `found` off its hook if its agent is gone; otherwise it is returned, to be
    /// reported (also when taking it off failed).
    pub(super) fn judge(
        &mut self,
        mut found: ForeignClassifier,
        owner: Owner,
        index: u32,
        hook: TcAttachType,
    ) -> Option<ForeignClassifier> {
        match owner {
            Owner::Ours | Owner::Unseen => None,
            Owner::Live(folder) => {
                found.pin_dir = Some(folder);
                found.agent_running = true;
                Some(found)
            }
            Owner::Unknown => Some(found),
            Owner::Stale(folder) => {
                let program = HOOKS
                    .iter()
                    .map(|(p, _, _)| *p)
                    .find(|p| *p == found.program)
                    .unwrap_or(TC_PROGRAM);
                // What was done, when it is still to be logged.
                let taken = match found.attach {
                    "tcx" => {
                        unpin_stale(&folder, found.program_id, index).map(|_| Some("detached"))
                    }
                    // Ours at that place: the program is swapped in (no gap), and
                    // `attach_one` reports it.
                    _ if self.hook == TcHook::Clsact => {
                        let prefix = HOOKS
                            .iter()
                            .find(|(p, _, _)| *p == program)
                            .map_or("", |h| h.2);
                        let name = found.interface.clone();
                        self.attach_one(&name, index, program, hook, prefix)
                            .map(|_| None)
                    }
                    _ => clsact::remove(index, hook, program).and_then(|gone| {
                        if !gone {
                            fail!(ErrorKind::Attach, "the filter went meanwhile");
                        }
                        Ok(Some("deleted"))
                    }),
                };
                match taken {
                    Ok(None) => None,
                    Ok(Some(how)) => {
                        self.took_stale(
                            &found.interface,
                            hook,
                            found.attach,
                            program,
                            &folder,
                            how,
                        );
                        None
                    }
                    Err(e) => {
                        tracing::warn!(
                            interface = found.interface,
                            program_id = found.program_id,
                            pin_dir = %folder.display(),
                            error = format!("{e:#}"),
                            "a stale classifier of another pin folder could not be taken off"
                        );
                        found.pin_dir = Some(folder);
                        Some(found)
                    }
                }
            }
        }
    }

    /// Logs and counts a stale classifier taken off (or over).
    pub(super) fn took_stale(
        &self,
        interface: &str,
        hook: TcAttachType,
        attach: &str,
        program: &str,
        folder: &Path,
        how: &str,
    ) {
        self.hooks.count_stale_removed();
        tracing::warn!(
            interface,
            hook = clsact::hook_name(hook),
            attach,
            program,
            pin_dir = %folder.display(),
            how,
            "a stale classifier of another pin folder (no agent holds it) was on our interface; taken off"
        );
    }

    /// Records the foreign classifiers now on `name`'s hooks: each new one is logged as an
    /// error (naming its program and where it is pinned), each one gone as an info.
    pub(super) fn set_foreign(&mut self, name: &str, now: Vec<ForeignClassifier>) {
        let before = self.foreign.remove(name).unwrap_or_default();
        if before.is_empty() && now.is_empty() {
            return;
        }
        for f in &now {
            if before.iter().any(|b| b.key() == f.key()) {
                continue;
            }
            let advice = match (&f.pin_dir, f.agent_running) {
                (Some(_), true) => {
                    "another agent serves this interface: stop one, or give them disjoint --interfaces"
                }
                (Some(_), false) => "its agent is gone but it could not be taken off",
                (None, _) => "no pin folder on our bpffs holds its maps: remove it by hand",
            };
            tracing::error!(
                interface = f.interface,
                hook = f.hook,
                attach = f.attach,
                program = f.program,
                program_id = f.program_id,
                pin_dir = f.pin_dir.as_deref().map(|p| p.display().to_string()),
                agent_running = f.agent_running,
                shadows_ours = f.shadows_ours,
                advice,
                "a foreign classifier is on an interface we serve; /healthz fails while it is there"
            );
        }
        for b in &before {
            if !now.iter().any(|f| f.key() == b.key()) {
                tracing::info!(
                    interface = b.interface,
                    hook = b.hook,
                    attach = b.attach,
                    program_id = b.program_id,
                    "foreign classifier gone"
                );
            }
        }
        if !now.is_empty() {
            self.foreign.insert(name.to_string(), now);
        }
        self.hooks
            .set_foreign(self.foreign.values().flatten().cloned().collect());
    }

    pub(super) fn detach(&mut self, name: &str, why: &str) {
        self.set_foreign(name, Vec::new());
        self.xdp_refused.remove(name);
        // XDP first: what it would pass on needs the classifier.
        xdp::detach(&self.xdp, &self.links_dir, name);
        let index = self.attached.remove(name);
        for (_, _, prefix) in HOOKS {
            match remove_pin(&pin_path(&self.links_dir, prefix, name)) {
                Ok(()) => tracing::info!(interface = name, prefix, why, "classifier link unpinned"),
                Err(e) => {
                    self.failures.count();
                    tracing::warn!(interface = name, error = format!("{e:#}"), "stale pin left");
                }
            }
        }
        // A device still there (renamed, or no longer wanted) keeps no filter of ours; one
        // that is gone took them along.
        if let Some(index) = index
            && self.hook == TcHook::Clsact
        {
            self.remove_filters(index, name, why);
        }
    }

    /// Deletes our clsact filters from `index` (and the qdisc, when we added it and it is
    /// unused now).
    pub(super) fn remove_filters(&mut self, index: u32, name: &str, why: &str) {
        for (program, hook) in FILTERS {
            match clsact::remove(index, hook, program) {
                Ok(true) => tracing::info!(interface = name, program, why, "clsact filter deleted"),
                Ok(false) => {}
                Err(e) => {
                    self.failures.count();
                    tracing::warn!(interface = name, error = format!("{e:#}"), "filter left");
                }
            }
        }
        if let Err(e) = clsact::release_qdisc(&self.links_dir, index) {
            tracing::warn!(
                interface = name,
                error = format!("{e:#}"),
                "clsact qdisc left"
            );
        }
    }
}
