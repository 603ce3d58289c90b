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
//! so a hostile or broken peer cannot make the plugin buffer without bound; a frame for a
//! conn other than 1 and 2 is dropped, as NRI's own multiplexer drops it.

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
}

/// Reads one multiplexer frame: `(conn, payload)`; `Ok(None)` at a clean end of stream.
pub(crate) fn read_frame(r: &mut impl Read) -> Result<Option<(u32, Vec<u8>)>, WireError> {
    let mut hdr = [0u8; 8];
    match r.read_exact(&mut hdr) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(WireError::Read(e)),
    }
    let conn = u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let len = u32::from_be_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]) as usize;
    if len > MAX_FRAME {
        return Err(WireError::FrameTooLarge { conn, len });
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).map_err(WireError::Read)?;
    Ok(Some((conn, payload)))
}

/// One ttrpc message as the bytes of a frame: header and body.
pub(crate) fn ttrpc_message(stream: u32, typ: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(TTRPC_HEADER + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&stream.to_be_bytes());
    out.push(typ);
    out.push(0);
    out.extend_from_slice(body);
    out
}

/// Writes `bytes` on `conn` as one frame (a ttrpc message never exceeds a frame).
pub(crate) fn write_frame(w: &mut impl Write, conn: u32, bytes: &[u8]) -> Result<(), WireError> {
    let mut frame = Vec::with_capacity(8 + bytes.len());
    frame.extend_from_slice(&conn.to_be_bytes());
    frame.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
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
        let msg = ttrpc_message(3, TYPE_REQUEST, b"hello world");
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
        let mut two = ttrpc_message(5, TYPE_RESPONSE, b"");
        two.extend(ttrpc_message(7, TYPE_RESPONSE, b"ab"));
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
    }
}
