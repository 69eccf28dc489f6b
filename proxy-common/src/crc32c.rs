//! CRC32c — SCTP's checksum — arithmetic for rewriting ports in place. The CRC is linear:
//! when the first word of an `len`-byte packet changes by `delta` (xor), its checksum
//! changes by the raw CRC of `delta` followed by `len - 4` zero bytes, whatever the rest
//! holds. Branch-free and bounded, so the verifier walks it quickly.

/// The CRC32c polynomial, bit-reflected.
pub const POLY: u32 = 0x82F6_3B78;

/// `a·b mod POLY` in the reflected representation (bit 31 is x^0).
#[inline(always)]
pub const fn mul(a: u32, mut b: u32) -> u32 {
    let mut p = 0;
    let mut i = 0;
    while i < 32 {
        p ^= b & ((a >> (31 - i)) & 1).wrapping_neg();
        b = (b >> 1) ^ (POLY & (b & 1).wrapping_neg());
        i += 1;
    }
    p
}

/// `X2N[k] = x^(2^k) mod POLY`.
pub const X2N: [u32; 32] = {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30; // x^1
    let mut k = 0;
    while k < 32 {
        t[k] = p;
        p = mul(p, p);
        k += 1;
    }
    t
};

/// `x^(8·n) mod POLY`: what `n` (< 65 536) zero bytes do to a CRC.
#[inline(always)]
pub fn zeros(n: u32) -> u32 {
    let mut p = 1u32 << 31; // x^0
    let mut k = 0;
    while k < 16 {
        let m = mul(X2N[(k + 3) & 31], p);
        let take = ((n >> k) & 1).wrapping_neg();
        p = (m & take) | (p & !take);
        k += 1;
    }
    p
}

/// The raw CRC (no initial value, no final xor) of four bytes, given as the
/// little-endian word they make.
#[inline(always)]
pub const fn word(mut c: u32) -> u32 {
    let mut i = 0;
    while i < 32 {
        c = (c >> 1) ^ (POLY & (c & 1).wrapping_neg());
        i += 1;
    }
    c
}

/// The checksum (as the little-endian word SCTP stores) of a packet whose first four
/// bytes changed by `delta`, given `zeros(len)` for its length `len`: the raw CRC of
/// a word is the word times x^32, so the shift past the word and the `len - 4`
/// bytes after it is `zeros(len)`.
#[inline(always)]
pub fn after_first_word_change(checksum: u32, delta: u32, zeros_len: u32) -> u32 {
    checksum ^ mul(zeros_len, delta)
}

/// The checksum SCTP stores (as a little-endian word) for `packet` (the SCTP header
/// and chunks), its checksum field taken as zero. Bit by bit: for tools and tests.
pub fn sctp_checksum(packet: &[u8]) -> u32 {
    let mut c = !0u32;
    let mut i = 0;
    while i < packet.len() {
        c ^= if (8..12).contains(&i) {
            0
        } else {
            packet[i] as u32
        };
        let mut bit = 0;
        while bit < 8 {
            c = (c >> 1) ^ (POLY & (c & 1).wrapping_neg());
            bit += 1;
        }
        i += 1;
    }
    !c
}

/// Entries of the `SCTP_ZEROS` table (`zeros(len)` at index `len`): SCTP packets shorter
/// than this get their ports rewritten with a valid checksum. (Longer ones only come
/// as offloaded segments whose CRC the kernel computes later.)
pub const TABLE_LEN: u32 = 16_384;

#[cfg(test)]
mod tests {
    use super::sctp_checksum as sctp_crc;

    #[test]
    fn crc32c_known_value_and_port_rewrite() {
        // RFC 3720 B.4: 32 bytes of zeros.
        let mut c = !0u32;
        for _ in 0..32 {
            for _ in 0..8 {
                c = (c >> 1) ^ (super::POLY & (c & 1).wrapping_neg());
            }
        }
        assert_eq!(!c, 0x8A91_36AA);
        for len in [12usize, 16, 17, 100, 1480, 9000, 65_000] {
            let mut pkt: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let before = sctp_crc(&pkt);
            let old = u32::from_le_bytes([pkt[0], pkt[1], pkt[2], pkt[3]]);
            pkt[0..4].copy_from_slice(&[0x12, 0x34, 0xab, 0xcd]);
            let new = u32::from_le_bytes([pkt[0], pkt[1], pkt[2], pkt[3]]);
            let zeros = super::zeros(len as u32);
            assert_eq!(
                super::after_first_word_change(before, old ^ new, zeros),
                sctp_crc(&pkt),
                "len {len}"
            );
        }
    }
}
