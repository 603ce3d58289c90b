//! The two framings on an NRI plugin's one connection to the runtime.
//!
//! NRI multiplexes two logical connections over the plugin's socket (NRI's
//! `pkg/net/multiplex`): every write is a frame `[conn id: u32 BE][length: u32 BE]` and
//! `length` bytes. Conn 1 carries the plugin's service (the runtime calls, the plugin
//! answers), conn 2 the runtime's service (the plugin calls `RegisterPlugin`). Frames cut
//! a logical connection's bytes anywhere: each conn is a byte stream of its own.
//!
//! On each conn the bytes are ttrpc messages
//! (<https://github.com/containerd/ttrpc/blob/main/PROTOCOL.md>): a 10-byte
//! header `[length: u32 BE][stream id: u32 BE][type: u8][flags: u8]` and `length` bytes of
//! protobuf; type 1 a request (`api::Request`), 2 a response (`api::Response`). A client
//! numbers its streams with odd ids.
//!
//! Invariants: no frame or message is larger than ttrpc's own limit (4 MiB plus a header),
//! so a hostile or broken peer cannot make the plugin buffer without bound, and a frame's
//! buffer grows with the bytes that arrive, not with the length its header claims; a frame
//! for a conn other than 1 and 2 is dropped, as NRI's own multiplexer drops it; a
//! connection that ends inside a frame is an error, never a clean end. Nothing here
//! panics on what a peer sends (the fuzz target `nri` drives it).
//!
//! Why not the `ttrpc` crate (containerd's ttrpc-rust, 0.10.0): it does not fit NRI's
//! connection, and it weighs more than the 127 lines of code here. Its synchronous `Server`
//! serves only connections it accepts itself (`bind`, `add_listener`: it listens and
//! accepts), and its `Client` owns a connected socket and drops every message that does
//! not answer a request of its own; the plugin dials (or is handed) one connected socket
//! on which it serves conn 1 and is a client on conn 2, behind a multiplexer the crate
//! does not have. With it, the multiplexer would stay, and a socket pair per logical conn
//! with a thread pumping each, and a listening socket for the server to accept its conn
//! from, would be added. By `cargo tree -e normal,build`, `features = ["sync", "prost"]`
//! pulls in 49 crates: 17 this crate's tree lacks (crossbeam's six, prost-build with
//! petgraph and prettyplease, byteorder, log, ...) and second copies of six it has at
//! another version: nix 0.26 beside 0.31, bitflags 1, and prost 0.13 beside 0.14, whose
//! `Message` is not the one `api`'s types derive; its build runs `protoc`. The default
//! features (rust-protobuf) pull in 47, with a second protobuf runtime. What the crate
//! would have given, the framing and its checks, is pinned by this module's tests and by
//! the session's over a socket pair (`nri`'s tests).

use std::io::{Read, Write};

/// The plugin's service.
pub(crate) const PLUGIN_CONN: u32 = 1;
/// The runtime's service.
pub(crate) const RUNTIME_CONN: u32 = 2;

/// ttrpc's largest message body.
pub(crate) const MAX_MESSAGE: usize = 4 << 20;
const TTRPC_HEADER: usize = 10;
/// The largest multiplexer frame: one ttrpc message with its header.
const MAX_FRAME: usize = MAX_MESSAGE + TTRPC_HEADER;

pub(crate) const TYPE_REQUEST: u8 = 1;
pub(crate) const TYPE_RESPONSE: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    #[error("read from the runtime's connection")]
    Read(#[source] std::io::Error),
    #[error("write to the runtime's connection")]
    Write(#[source] std::io::Error),
    #[error(
        "the runtime sent a frame of {len} bytes on conn {conn}: allowed is at most {MAX_FRAME}"
    )]
    FrameTooLarge { conn: u32, len: usize },
    #[error("the runtime sent a ttrpc message of {len} bytes: allowed is at most {MAX_MESSAGE}")]
    MessageTooLarge { len: usize },
    #[error("the runtime's connection ended inside a {what}: {got} of its {want} bytes came")]
    Truncated {
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("the plugin's message of {len} bytes is larger than ttrpc allows ({MAX_MESSAGE})")]
    Oversized { len: usize },
}

/// Reads one multiplexer frame: `(conn, payload)`; `Ok(None)` at a clean end of stream
/// (between two frames).
pub(crate) fn read_frame(r: &mut impl Read) -> Result<Option<(u32, Vec<u8>)>, WireError> {
    let mut hdr = Vec::with_capacity(8);
    let got = r
        .by_ref()
        .take(8)
        .read_to_end(&mut hdr)
        .map_err(WireError::Read)?;
    match got {
        0 => return Ok(None),
        8 => {}
        got => {
            return Err(WireError::Truncated {
                what: "frame header",
                got,
                want: 8,
            })
        }
    }
    let conn = u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let len = u32::from_be_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]) as usize;
    if len > MAX_FRAME {
        return Err(WireError::FrameTooLarge { conn, len });
    }
    // Grown as the bytes come: a header alone, however long it says the frame is,
    // allocates nothing.
    let mut payload = Vec::new();
    let got = r
        .by_ref()
        .take(len as u64)
        .read_to_end(&mut payload)
        .map_err(WireError::Read)?;
    if got < len {
        return Err(WireError::Truncated {
            what: "frame",
            got,
            want: len,
        });
    }
    Ok(Some((conn, payload)))
}

/// One ttrpc message as the bytes of a frame: header and body.
pub(crate) fn ttrpc_message(stream: u32, typ: u8, body: &[u8]) -> Result<Vec<u8>, WireError> {
    // The runtime's ttrpc refuses a larger message; its length must fit the header.
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l as usize <= MAX_MESSAGE)
        .ok_or(WireError::Oversized { len: body.len() })?;
    let mut out = Vec::with_capacity(TTRPC_HEADER + body.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&stream.to_be_bytes());
    out.push(typ);
    out.push(0);
    out.extend_from_slice(body);
    Ok(out)
}

/// Writes `bytes` on `conn` as one frame (a ttrpc message never exceeds a frame).
pub(crate) fn write_frame(w: &mut impl Write, conn: u32, bytes: &[u8]) -> Result<(), WireError> {
    let len = u32::try_from(bytes.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or(WireError::Oversized { len: bytes.len() })?;
    let mut frame = Vec::with_capacity(8 + bytes.len());
    frame.extend_from_slice(&conn.to_be_bytes());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(bytes);
    w.write_all(&frame).map_err(WireError::Write)
}

/// One ttrpc message taken off a conn's byte stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Message {
    pub stream: u32,
    pub typ: u8,
    pub body: Vec<u8>,
}

/// The bytes of one logical connection, as frames deliver them, cut into ttrpc messages.
#[derive(Debug, Default)]
pub(crate) struct Stream {
    buf: Vec<u8>,
}

impl Stream {
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The bytes of a message not yet whole (at the end of the connection: a cut message).
    pub(crate) fn pending(&self) -> usize {
        self.buf.len()
    }

    /// The next whole message, if the bytes so far hold one.
    pub(crate) fn next_message(&mut self) -> Result<Option<Message>, WireError> {
        if self.buf.len() < TTRPC_HEADER {
            return Ok(None);
        }
        let b = &self.buf;
        let len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
        if len > MAX_MESSAGE {
            return Err(WireError::MessageTooLarge { len });
        }
        if b.len() < TTRPC_HEADER + len {
            return Ok(None);
        }
        let stream = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        let typ = b[8];
        let body = b[TTRPC_HEADER..TTRPC_HEADER + len].to_vec();
        self.buf.drain(..TTRPC_HEADER + len);
        Ok(Some(Message { stream, typ, body }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_messages_reassemble_across_frames() {
        let msg = ttrpc_message(3, TYPE_REQUEST, b"hello world").unwrap();
        let mut wire = Vec::new();
        // One message cut into three frames, another conn's frame between them.
        write_frame(&mut wire, PLUGIN_CONN, &msg[..4]).unwrap();
        write_frame(&mut wire, RUNTIME_CONN, b"x").unwrap();
        write_frame(&mut wire, PLUGIN_CONN, &msg[4..12]).unwrap();
        write_frame(&mut wire, PLUGIN_CONN, &msg[12..]).unwrap();
        let mut r = &wire[..];
        let mut s = Stream::default();
        let mut got = Vec::new();
        while let Some((conn, payload)) = read_frame(&mut r).unwrap() {
            if conn == PLUGIN_CONN {
                s.push(&payload);
                while let Some(m) = s.next_message().unwrap() {
                    got.push(m);
                }
            } else {
                assert_eq!((conn, payload.as_slice()), (RUNTIME_CONN, &b"x"[..]));
            }
        }
        assert_eq!(
            got,
            vec![Message {
                stream: 3,
                typ: TYPE_REQUEST,
                body: b"hello world".to_vec()
            }]
        );
        // Two messages in one frame come out one by one.
        let mut two = ttrpc_message(5, TYPE_RESPONSE, b"").unwrap();
        two.extend(ttrpc_message(7, TYPE_RESPONSE, b"ab").unwrap());
        s.push(&two);
        assert_eq!(s.next_message().unwrap().unwrap().stream, 5);
        assert_eq!(s.next_message().unwrap().unwrap().body, b"ab");
        assert!(s.next_message().unwrap().is_none());
    }

    #[test]
    fn oversized_frames_and_messages_are_refused() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&1u32.to_be_bytes());
        wire.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            read_frame(&mut &wire[..]),
            Err(WireError::FrameTooLarge { .. })
        ));
        let mut s = Stream::default();
        let mut hdr = ((MAX_MESSAGE + 1) as u32).to_be_bytes().to_vec();
        hdr.extend_from_slice(&[0, 0, 0, 1, 1, 0]);
        s.push(&hdr);
        assert!(matches!(
            s.next_message(),
            Err(WireError::MessageTooLarge { .. })
        ));
        assert!(read_frame(&mut &[][..]).unwrap().is_none());
        // The plugin never writes what the runtime's ttrpc would refuse.
        assert!(matches!(
            ttrpc_message(1, TYPE_RESPONSE, &vec![0; MAX_MESSAGE + 1]),
            Err(WireError::Oversized { .. })
        ));
    }

    #[test]
    fn a_connection_cut_inside_a_frame_is_an_error_not_an_end() {
        let mut wire = Vec::new();
        write_frame(&mut wire, PLUGIN_CONN, b"0123456789").unwrap();
        // Cut in the header: before, a clean end of the connection.
        for cut in 1..8 {
            let err = read_frame(&mut &wire[..cut]).unwrap_err();
            assert!(
                matches!(err, WireError::Truncated { what: "frame header", got, want: 8 } if got == cut),
                "{err}"
            );
        }
        // Cut in the payload.
        let err = read_frame(&mut &wire[..12]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the runtime's connection ended inside a frame: 4 of its 10 bytes came"
        );
        // A header that claims the largest frame, and then the end: an error, with no
        // buffer of that size behind it.
        let mut claim = PLUGIN_CONN.to_be_bytes().to_vec();
        claim.extend_from_slice(&(MAX_FRAME as u32).to_be_bytes());
        claim.extend_from_slice(b"abc");
        assert!(matches!(
            read_frame(&mut &claim[..]),
            Err(WireError::Truncated {
                what: "frame",
                got: 3,
                ..
            })
        ));
    }
}
