//! A request/answer netlink channel, shared by the sock_diag and conntrack clean-ups.

use crate::error::{Error, ErrorKind, Kind as _, Result, fail};
use netlink_packet_core::{
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_sys::{Socket, SocketAddr};

/// A netlink socket of one protocol, in the calling thread's network namespace.
pub struct Channel {
    socket: Socket,
    seq: u32,
}

impl Channel {
    pub fn open(protocol: isize, what: &str) -> Result<Self> {
        let mut socket = Socket::new(protocol)
            .kind_with(ErrorKind::Netlink, || format!("opening a {what} socket"))?;
        socket
            .bind_auto()
            .kind_with(ErrorKind::Netlink, || format!("binding the {what} socket"))?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .kind_with(ErrorKind::Netlink, || {
                format!("connecting the {what} socket")
            })?;
        Ok(Self { socket, seq: 0 })
    }

    /// Sends one request; `message_type` overrides the payload's own type (for request
    /// kinds the message crate does not name). Returns its sequence number.
    pub fn send<T: NetlinkSerializable>(
        &mut self,
        flags: u16,
        message_type: Option<u16>,
        payload: T,
    ) -> Result<u32> {
        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
        packet.finalize();
        if let Some(t) = message_type {
            packet.header.message_type = t;
        }
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket
            .send(&buf, 0)
            .kind(ErrorKind::Netlink, "sending a netlink request")?;
        Ok(self.seq)
    }

    /// Reads the messages answering request `seq` until `each` says the answer is
    /// complete.
    pub fn receive<T: NetlinkDeserializable>(
        &mut self,
        seq: u32,
        mut each: impl FnMut(NetlinkPayload<T>) -> Result<bool>,
    ) -> Result<()> {
        loop {
            let (buf, _) = self
                .socket
                .recv_from_full()
                .kind(ErrorKind::Netlink, "reading a netlink answer")?;
            let mut offset = 0;
            while offset < buf.len() {
                let msg = NetlinkMessage::<T>::deserialize(&buf[offset..])
                    .kind(ErrorKind::Netlink, "decoding a netlink message")?;
                let len = msg.header.length as usize;
                if len == 0 {
                    fail!(ErrorKind::Netlink, "netlink message of length 0");
                }
                offset += (len + 3) & !3; // NLMSG_ALIGN
                if msg.header.sequence_number != seq {
                    continue;
                }
                if each(msg.payload)? {
                    return Ok(());
                }
            }
        }
    }

    /// Sends a request that changes something and waits for its acknowledgement.
    pub fn act<T: NetlinkSerializable + NetlinkDeserializable>(
        &mut self,
        flags: u16,
        message_type: Option<u16>,
        payload: T,
    ) -> Result<()> {
        let seq = self.send(
            flags | netlink_packet_core::NLM_F_REQUEST | netlink_packet_core::NLM_F_ACK,
            message_type,
            payload,
        )?;
        self.receive::<T>(seq, |payload| match payload {
            NetlinkPayload::Error(e) if e.code.is_some() => {
                Err(Error::new(ErrorKind::Netlink, e.to_string()))
            }
            NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => Ok(true),
            _ => Ok(false),
        })
    }
}
