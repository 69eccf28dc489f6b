//! Interfaces appearing and vanishing, from rtnetlink: a dump of every link, then the
//! kernel's RTNLGRP_LINK notifications, in the network namespace the socket was opened in.

use std::{
    io,
    os::fd::{AsRawFd, RawFd},
};

use crate::error::{ErrorKind, Kind as _, Result};
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkAttribute, LinkLayerType, LinkMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::interfaces::DeviceKind;

/// rtnetlink's multicast group for link changes (RTNLGRP_LINK).
const RTNLGRP_LINK: u32 = 1;

/// One network device as rtnetlink describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub index: u32,
    pub name: String,
    pub kind: DeviceKind,
    /// The device it is a port of (a bridge, a bond), if any.
    pub master: Option<u32>,
}

/// What a message from the kernel says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChange {
    /// The device exists (new, changed, or listed by a dump).
    Present(Device),
    /// The device is gone from this namespace (deleted, or moved to another one).
    Gone(Device),
    /// The dump is complete; `interrupted` means links changed during it (dump again).
    DumpDone { interrupted: bool },
}

/// A route netlink socket subscribed to link changes.
pub struct DeviceEvents {
    socket: Socket,
    seq: u32,
    dump_interrupted: bool,
}

impl DeviceEvents {
    /// Subscribes first, so no change between the dump and the notifications is lost.
    pub fn open() -> Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)
            .kind(ErrorKind::Netlink, "opening a route netlink socket")?;
        socket
            .bind(&SocketAddr::new(0, 0))
            .kind(ErrorKind::Netlink, "binding the route netlink socket")?;
        socket.add_membership(RTNLGRP_LINK).kind(
            ErrorKind::Netlink,
            "subscribing to link changes (RTNLGRP_LINK)",
        )?;
        Ok(Self {
            socket,
            seq: 0,
            dump_interrupted: false,
        })
    }

    /// Asks for every link; the answers come through [`Self::read`], ending with
    /// [`DeviceChange::DumpDone`].
    pub fn request_dump(&mut self) -> Result<()> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = self.seq;
        let mut msg = NetlinkMessage::new(
            header,
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetLink(LinkMessage::default())),
        );
        msg.finalize();
        let mut buf = vec![0; msg.buffer_len()];
        msg.serialize(&mut buf);
        self.socket
            .send_to(&buf, &SocketAddr::new(0, 0), 0)
            .kind(ErrorKind::Netlink, "asking rtnetlink for every link")?;
        Ok(())
    }

    pub fn set_non_blocking(&self) -> Result<()> {
        self.socket.set_non_blocking(true).kind(
            ErrorKind::Netlink,
            "making the route netlink socket non-blocking",
        )
    }

    /// Reads one datagram and decodes the link changes in it. `ENOBUFS` means
    /// notifications were dropped (the caller dumps again); `WouldBlock` that nothing
    /// is waiting on a non-blocking socket.
    pub fn read(&mut self) -> io::Result<Vec<DeviceChange>> {
        let (buf, _) = self.socket.recv_from_full()?;
        Ok(self.decode(&buf))
    }

    fn decode(&mut self, buf: &[u8]) -> Vec<DeviceChange> {
        let mut changes = Vec::new();
        let mut offset = 0;
        while offset < buf.len() {
            let msg = match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[offset..]) {
                Ok(m) => m,
                Err(e) => {
                    // The rest of the datagram cannot be framed without this header.
                    tracing::warn!(error = %e, "undecodable rtnetlink message; skipped");
                    break;
                }
            };
            let len = msg.header.length as usize;
            if len == 0 {
                break;
            }
            offset += (len + 3) & !3; // NLMSG_ALIGN
            if msg.header.flags & NLM_F_DUMP_INTR != 0 {
                self.dump_interrupted = true;
            }
            match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(m)) => {
                    changes.extend(link_of(&m).map(DeviceChange::Present));
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(m)) => {
                    changes.extend(link_of(&m).map(DeviceChange::Gone));
                }
                NetlinkPayload::Done(_) => changes.push(DeviceChange::DumpDone {
                    interrupted: std::mem::take(&mut self.dump_interrupted),
                }),
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    tracing::warn!(error = %e, "rtnetlink refused the link dump");
                    changes.push(DeviceChange::DumpDone { interrupted: true });
                }
                _ => {}
            }
        }
        changes
    }
}

/// Every link of the calling thread's network namespace, now.
pub fn list() -> Result<Vec<Device>> {
    let mut events = DeviceEvents::open()?;
    events.request_dump()?;
    let mut links = Vec::new();
    loop {
        for change in events
            .read()
            .kind(ErrorKind::Netlink, "reading the link dump")?
        {
            match change {
                DeviceChange::Present(link) => links.push(link),
                DeviceChange::Gone(_) => {}
                DeviceChange::DumpDone { interrupted: false } => return Ok(links),
                DeviceChange::DumpDone { interrupted: true } => {
                    links.clear();
                    events.request_dump()?;
                }
            }
        }
    }
}

impl AsRawFd for DeviceEvents {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

fn link_of(m: &LinkMessage) -> Option<Device> {
    let name = m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })?;
    let kind = match m.header.link_layer_type {
        LinkLayerType::Ether => DeviceKind::Ethernet,
        LinkLayerType::Loopback => DeviceKind::Loopback,
        other => DeviceKind::Other(u16::from(other)),
    };
    let master = m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Controller(i) if *i != 0 => Some(*i),
        _ => None,
    });
    Some(Device {
        index: m.header.index,
        name,
        kind,
        master,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bridge's port names its bridge (`IFLA_MASTER`); a device without one names none.
    #[test]
    fn a_port_names_its_master() {
        let mut m = LinkMessage::default();
        m.header.index = 7;
        m.header.link_layer_type = LinkLayerType::Ether;
        m.attributes.push(LinkAttribute::IfName("veth1".into()));
        assert_eq!(link_of(&m).map(|l| l.master), Some(None));
        m.attributes.push(LinkAttribute::Controller(3));
        let link = link_of(&m).expect("a link");
        assert_eq!((link.index, link.master), (7, Some(3)));
    }
}
