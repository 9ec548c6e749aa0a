//! Reading one HTTP/1.1 response to a GET, in place in one buffer: the head (status and
//! the headers that frame the body), then the body by its `content-length`, its chunks
//! (decoded where they lie), or to the connection's close. Pure functions over bytes, so
//! every framing case is tested without sockets; the connection feeds them.

/// The most bytes a response head may take.
pub(super) const MAX_HEAD: usize = 16 * 1024;
/// Headers read of a head; a pod's answer has a handful.
const MAX_HEADERS: usize = 48;

/// How a response's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    Length(usize),
    Chunked,
    /// To the end of the connection (HTTP/1.1 without length or chunks).
    UntilClose,
}

/// A response head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Head {
    pub(super) status: u16,
    /// Bytes the head took, its blank line included.
    pub(super) len: usize,
    pub(super) framing: Framing,
    /// The connection can carry another request after this response.
    pub(super) keep_alive: bool,
}

/// What a malformed or unsupported response is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum FramingError {
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("response head larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("unreadable content-length")]
    Length,
}

/// Parses a response head at the start of `bytes`; `None`: not all of it is there yet.
/// Informational answers (1xx) are skipped: the head returned is the final one, its `len`
/// counted from the start of `bytes`.
pub(super) fn parse_head(bytes: &[u8]) -> Result<Option<Head>, FramingError> {
    let mut offset = 0;
    loop {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let len = match response.parse(&bytes[offset..]) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if bytes.len() - offset > MAX_HEAD => {
                return Err(FramingError::HeadTooLarge);
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(error) => return Err(FramingError::Head(error.to_string())),
        };
        let status = response.code.unwrap_or(0);
        if (100..200).contains(&status) {
            offset += len;
            continue;
        }
        let mut framing = Framing::UntilClose;
        let mut keep_alive = response.version == Some(1);
        let mut length = None;
        for header in response.headers.iter() {
            let name = header.name;
            if name.eq_ignore_ascii_case("content-length") {
                let value = std::str::from_utf8(header.value)
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .ok_or(FramingError::Length)?;
                // Repeated lengths must agree (RFC 9112, 6.3).
                if length.is_some_and(|l| l != value) {
                    return Err(FramingError::Length);
                }
                length = Some(value);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                if has_token(header.value, b"chunked") {
                    framing = Framing::Chunked;
                }
            } else if name.eq_ignore_ascii_case("connection") {
                if has_token(header.value, b"close") {
                    keep_alive = false;
                } else if has_token(header.value, b"keep-alive") {
                    keep_alive = true;
                }
            }
        }
        // Chunks win over a length (RFC 9112, 6.3); a response with neither ends with the
        // connection, which then cannot be kept.
        match (framing, length) {
            (Framing::Chunked, _) => {}
            (_, Some(length)) => framing = Framing::Length(length),
            _ => keep_alive = false,
        }
        // 204 and 304 have no body, whatever they say.
        if status == 204 || status == 304 {
            framing = Framing::Length(0);
        }
        return Ok(Some(Head {
            status,
            len: offset + len,
            framing,
            keep_alive,
        }));
    }
}

/// Whether a comma-separated header value holds `token` (case-insensitive).
fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|b| *b == b',')
        .any(|part| part.trim_ascii().eq_ignore_ascii_case(token))
}

/// Decodes a chunked body where it lies: the chunks' data moved down over their framing,
/// from `start` of the buffer. Fed the buffer again as more arrives, it resumes where it
/// stopped.
#[derive(Debug)]
pub(super) struct Dechunker {
    /// Where the body starts (the decoded one as the raw one).
    start: usize,
    /// Where the next decoded byte goes.
    out: usize,
    /// Where the next undecoded byte is.
    at: usize,
    /// Data bytes of the current chunk still to move, when inside one (plus its CRLF).
    left_in_chunk: Option<usize>,
    /// Past the last chunk: reading its trailers until the blank line.
    in_trailers: bool,
}

impl Dechunker {
    pub(super) fn new(start: usize) -> Dechunker {
        Dechunker {
            start,
            out: start,
            at: start,
            left_in_chunk: None,
            in_trailers: false,
        }
    }

    /// Decodes what it can of `buffer`; `Ok(Some(end))`: the body is whole, decoded in
    /// `buffer[start..end]` (`start` as given to [`Dechunker::new`]); `Ok(None)`: more bytes
    /// are needed. `limit` bounds the body.
    pub(super) fn feed(
        &mut self,
        buffer: &mut [u8],
        limit: usize,
    ) -> Result<Option<usize>, DechunkError> {
        loop {
            if self.in_trailers {
                // Trailer lines until a blank one; their content is not used.
                let rest = &buffer[self.at..];
                let Some(line) = memchr::memmem::find(rest, b"\r\n") else {
                    return Ok(None);
                };
                self.at += line + 2;
                if line == 0 {
                    return Ok(Some(self.out));
                }
                continue;
            }
            if let Some(left) = self.left_in_chunk {
                let available = (buffer.len() - self.at).min(left);
                buffer.copy_within(self.at..self.at + available, self.out);
                self.out += available;
                self.at += available;
                let left = left - available;
                if left > 0 {
                    self.left_in_chunk = Some(left);
                    return Ok(None);
                }
                // The chunk's closing CRLF.
                if buffer.len() - self.at < 2 {
                    self.left_in_chunk = Some(0);
                    return Ok(None);
                }
                if &buffer[self.at..self.at + 2] != b"\r\n" {
                    return Err(DechunkError::Malformed);
                }
                self.at += 2;
                self.left_in_chunk = None;
                continue;
            }
            // A chunk-size line: hex digits, perhaps extensions after ';', then CRLF.
            let rest = &buffer[self.at..];
            let Some(line) = memchr::memmem::find(rest, b"\r\n") else {
                if rest.len() > 1024 {
                    return Err(DechunkError::Malformed);
                }
                return Ok(None);
            };
            let digits = rest[..line]
                .split(|b| *b == b';')
                .next()
                .unwrap_or_default()
                .trim_ascii();
            let size = std::str::from_utf8(digits)
                .ok()
                .filter(|d| !d.is_empty() && d.len() <= 15)
                .and_then(|d| usize::from_str_radix(d, 16).ok())
                .ok_or(DechunkError::Malformed)?;
            self.at += line + 2;
            if size == 0 {
                self.in_trailers = true;
                continue;
            }
            if (self.out - self.start).saturating_add(size) > limit {
                return Err(DechunkError::TooLarge);
            }
            self.left_in_chunk = Some(size);
        }
    }

    /// Bytes of the buffer already consumed (decoded or framing) from the start of the
    /// undecoded part: what a reader may not overwrite.
    pub(super) fn consumed(&self) -> usize {
        self.at
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DechunkError {
    Malformed,
    TooLarge,
}

#[cfg(test)]
mod tests;
