//! The line protocol on `<pipe>/control`.
//!
//! The real daemon listens on a SOCK_SEQPACKET socket with a private binary protocol; the
//! simulator uses a SOCK_STREAM socket and newline-terminated UTF-8 lines, which is all a test
//! needs and lets `socat` talk to it. Every connection opens with one line from the peer:
//!
//! - a control command (`get_server_list`, …): the daemon answers `OK\n<body>` or
//!   `ERR\n<body>` and closes the connection;
//! - `CLIENT <pid> <thread-percentage|-> <pinned-mem-limits|->`, sent by the stand-in CUDA
//!   process: the daemon answers `QUEUED` (zero or one time), then either
//!   `READY server=<pid> server_uid=<uid> waited_ms=<n> active_thread_percentage=<p>
//!   pinned_mem_limit=<list|none>` or `ERROR <message>`. After READY the connection stays open
//!   while the client runs; closing it detaches the client.
//!
//! Invariants: no line exceeds [`MAX_LINE`] bytes, so a peer can never make the reader buffer
//! without bound; the client's uid, gid and pid never come from these lines (the daemon takes
//! them from SO_PEERCRED), the pid in `CLIENT` is informational only.

use std::io::{BufRead, Read};

use thiserror::Error;

use crate::limits::{DeviceLimits, LimitError, Percentage};

/// Longest line either side accepts, newline excluded.
pub const MAX_LINE: usize = 4096;

#[derive(Debug, Error)]
pub enum WireError {
    #[error("line longer than {MAX_LINE} bytes")]
    TooLong,
    #[error("line is not valid utf-8")]
    NotUtf8,
    #[error("read failed")]
    Io(#[from] std::io::Error),
    #[error("malformed client hello {line:?}")]
    Hello { line: String },
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("malformed reply {line:?}")]
    Reply { line: String },
}

/// Reads one line, without its `\n` (and a `\r` before it). `None` at a clean end of stream.
pub fn read_line<R: BufRead + ?Sized>(reader: &mut R) -> Result<Option<String>, WireError> {
    let mut buf = Vec::new();
    let limit = u64::try_from(MAX_LINE + 1).unwrap_or(u64::MAX);
    let n = Read::take(&mut *reader, limit).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_LINE {
        return Err(WireError::TooLong);
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| WireError::NotUtf8)
}

pub const HELLO_WORD: &str = "CLIENT";

/// What a stand-in CUDA process asks for: its own client-side limits, if it set any.
#[derive(Debug, Clone, PartialEq)]
pub struct Hello {
    pub pid: u32,
    pub percentage: Option<Percentage>,
    pub mem: DeviceLimits,
}

impl Hello {
    pub fn to_line(&self) -> String {
        let pct = self
            .percentage
            .map_or_else(|| "-".to_string(), |p| p.to_string());
        let mem = if self.mem == DeviceLimits::default() {
            "-".to_string()
        } else {
            self.mem.to_string()
        };
        format!("{HELLO_WORD} {} {pct} {mem}", self.pid)
    }

    /// Parses a line whose first word is [`HELLO_WORD`].
    pub fn parse(line: &str) -> Result<Self, WireError> {
        let bad = || WireError::Hello {
            line: line.to_string(),
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        let [word, pid, pct, mem] = words.as_slice() else {
            return Err(bad());
        };
        if *word != HELLO_WORD {
            return Err(bad());
        }
        let pid = pid.parse().map_err(|_| bad())?;
        let percentage = match *pct {
            "-" => None,
            p => Some(Percentage::parse(p)?),
        };
        let mem = match *mem {
            "-" => DeviceLimits::default(),
            m => DeviceLimits::parse(m)?,
        };
        Ok(Hello {
            pid,
            percentage,
            mem,
        })
    }
}

/// The daemon's answer once a client is attached to a server, with the limits that apply to
/// this client.
#[derive(Debug, Clone, PartialEq)]
pub struct Ready {
    pub server_pid: u32,
    pub server_uid: u32,
    pub waited_ms: u64,
    pub percentage: Percentage,
    pub mem: DeviceLimits,
    /// A v3 daemon's namespace and server name, appended as `namespace=<ns>
    /// server_name=<s>`; `None` from a legacy daemon, whose line stays as it was.
    pub names: Option<(String, String)>,
}

impl Ready {
    pub fn to_line(&self) -> String {
        let mut line = format!(
            "READY server={} server_uid={} waited_ms={} active_thread_percentage={} pinned_mem_limit={}",
            self.server_pid, self.server_uid, self.waited_ms, self.percentage, self.mem
        );
        if let Some((ns, server)) = &self.names {
            line.push_str(&format!(" namespace={ns} server_name={server}"));
        }
        line
    }

    pub fn parse(line: &str) -> Result<Self, WireError> {
        let bad = || WireError::Reply {
            line: line.to_string(),
        };
        let mut words = line.split_whitespace();
        if words.next() != Some("READY") {
            return Err(bad());
        }
        let mut field = |key: &str| -> Result<&str, WireError> {
            words
                .next()
                .and_then(|w| w.strip_prefix(key))
                .and_then(|w| w.strip_prefix('='))
                .ok_or_else(bad)
        };
        let server_pid = field("server")?.parse().map_err(|_| bad())?;
        let server_uid = field("server_uid")?.parse().map_err(|_| bad())?;
        let waited_ms = field("waited_ms")?.parse().map_err(|_| bad())?;
        let percentage = Percentage::parse(field("active_thread_percentage")?)?;
        let mem = DeviceLimits::parse(field("pinned_mem_limit")?)?;
        let names = match (words.next(), words.next()) {
            (None, None) => None,
            (Some(ns), Some(server)) => Some((
                ns.strip_prefix("namespace=").ok_or_else(bad)?.to_string(),
                server
                    .strip_prefix("server_name=")
                    .ok_or_else(bad)?
                    .to_string(),
            )),
            _ => return Err(bad()),
        };
        Ok(Ready {
            names,
            server_pid,
            server_uid,
            waited_ms,
            percentage,
            mem,
        })
    }
}

/// Frames a control command's answer: a status line, then the text the control client prints.
pub fn control_reply(result: &Result<String, String>) -> String {
    let (status, body) = match result {
        Ok(body) => ("OK", body),
        Err(body) => ("ERR", body),
    };
    if body.is_empty() || body.ends_with('\n') {
        format!("{status}\n{body}")
    } else {
        format!("{status}\n{body}\n")
    }
}

/// Splits a control answer read to the end of the stream back into success and body.
pub fn parse_control_reply(text: &str) -> Result<Result<String, String>, WireError> {
    let (status, body) = text.split_once('\n').unwrap_or((text, ""));
    match status {
        "OK" => Ok(Ok(body.to_string())),
        "ERR" => Ok(Err(body.to_string())),
        _ => Err(WireError::Reply {
            line: status.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    fn lines(input: &[u8]) -> Vec<Result<Option<String>, String>> {
        let mut reader = BufReader::new(input);
        let mut out = Vec::new();
        loop {
            let r = read_line(&mut reader).map_err(|e| e.to_string());
            let stop = !matches!(r, Ok(Some(_)));
            out.push(r);
            if stop {
                return out;
            }
        }
    }

    #[test]
    fn read_line_cases() {
        assert_eq!(
            lines(b"a\r\nb\nc"),
            vec![
                Ok(Some("a".into())),
                Ok(Some("b".into())),
                Ok(Some("c".into())),
                Ok(None)
            ]
        );
        let long = vec![b'x'; MAX_LINE + 10];
        assert!(lines(&long)[0].is_err());
        let mut exact = vec![b'x'; MAX_LINE];
        exact.push(b'\n');
        assert_eq!(
            lines(&exact)[0]
                .as_ref()
                .map(|l| l.as_ref().map(|s| s.len())),
            Ok(Some(MAX_LINE))
        );
        assert!(lines(b"\xff\xfe\n")[0].is_err());
    }

    #[test]
    fn hello_round_trip() {
        let hello = Hello {
            pid: 42,
            percentage: Some(Percentage::parse("25.5").unwrap()),
            mem: DeviceLimits::parse("0=1G").unwrap(),
        };
        assert_eq!(hello.to_line(), "CLIENT 42 25.5 0=1G");
        assert_eq!(Hello::parse(&hello.to_line()).unwrap(), hello);
        let bare = Hello::parse("CLIENT 7 - -").unwrap();
        assert_eq!(bare.percentage, None);
        assert_eq!(bare.to_line(), "CLIENT 7 - -");
        for bad in [
            "CLIENT",
            "CLIENT x - -",
            "CLIENT 1 - - extra",
            "CLIENT 1 0 -",
            "CLIENT 1 - 0=1T",
            "client 1 - -",
        ] {
            assert!(Hello::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ready_round_trip() {
        let ready = Ready {
            server_pid: 10,
            server_uid: 1000,
            waited_ms: 1234,
            percentage: Percentage::parse("25").unwrap(),
            mem: DeviceLimits::parse("0=1G,1=512M").unwrap(),
            names: None,
        };
        let line = ready.to_line();
        assert_eq!(
            line,
            "READY server=10 server_uid=1000 waited_ms=1234 active_thread_percentage=25.0 pinned_mem_limit=0=1G,1=512M"
        );
        assert_eq!(Ready::parse(&line).unwrap(), ready);
        assert!(Ready::parse("READY server=1").is_err());
        let v3 = Ready {
            names: Some(("a".into(), "s".into())),
            ..ready
        };
        assert!(v3.to_line().ends_with(" namespace=a server_name=s"));
        assert_eq!(Ready::parse(&v3.to_line()).unwrap(), v3);
        assert!(Ready::parse("QUEUED").is_err());
    }

    #[test]
    fn control_reply_round_trip() {
        for r in [
            Ok(String::new()),
            Ok("123\n".to_string()),
            Err("bad".to_string()),
        ] {
            let framed = control_reply(&r);
            let back = parse_control_reply(&framed).unwrap();
            let norm = |x: &Result<String, String>| match x {
                Ok(s) => Ok(s.trim_end().to_string()),
                Err(s) => Err(s.trim_end().to_string()),
            };
            assert_eq!(norm(&back), norm(&r));
        }
        assert!(parse_control_reply("HUH\n").is_err());
    }
}
