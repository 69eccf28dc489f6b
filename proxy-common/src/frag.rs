//! IPv4 fragments (`FRAGMENTS`).

/// An IPv4 datagram in fragments: later fragments carry no ports, so the first one's are
/// remembered under the datagram's identity (RFC 791: source, destination, protocol, id).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub saddr: u32,
    pub daddr: u32,
    /// Network byte order.
    pub id: u16,
    pub proto: u8,
    pub _pad: u8,
}

/// The ports of a fragmented datagram, from its first fragment (network byte order).
#[repr(C)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPorts {
    pub sport: u16,
    pub dport: u16,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    /// Sizes are part of the ABI: a change here must be a deliberate, versioned change.
    #[test]
    fn layout_is_stable() {
        assert_eq!(size_of::<FragKey>(), 12);
        assert_eq!(size_of::<FragPorts>(), 4);
    }
}
