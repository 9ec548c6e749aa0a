use super::*;

fn head(text: &str) -> Result<Option<Head>, FramingError> {
    parse_head(text.as_bytes())
}

#[test]
fn a_length_framed_head_is_read_whole_or_not_at_all() {
    let text = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nContent-Length: 12\r\n\r\nbody";
    let parsed = head(text).expect("valid").expect("whole");
    assert_eq!(parsed.status, 200);
    assert_eq!(parsed.framing, Framing::Length(12));
    assert_eq!(&text[parsed.len..], "body");
    assert!(parsed.keep_alive);
    for cut in 0..parsed.len {
        assert_eq!(head(&text[..cut]), Ok(None), "cut at {cut}");
    }
}

#[test]
fn chunks_win_over_a_length_and_close_or_http_1_0_ends_keep_alive() {
    let chunked =
        head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: gzip, Chunked\r\n\r\n");
    assert_eq!(
        chunked.expect("valid").expect("whole").framing,
        Framing::Chunked
    );
    let closing =
        head("HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 0\r\n\r\n");
    assert!(!closing.expect("valid").expect("whole").keep_alive);
    let old = head("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n")
        .expect("valid")
        .expect("whole");
    assert!(!old.keep_alive);
    let old_kept = head("HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n");
    assert!(old_kept.expect("valid").expect("whole").keep_alive);
}

#[test]
fn a_body_without_length_or_chunks_runs_to_the_close() {
    let parsed = head("HTTP/1.1 200 OK\r\n\r\n")
        .expect("valid")
        .expect("whole");
    assert_eq!(parsed.framing, Framing::UntilClose);
    assert!(!parsed.keep_alive);
    let empty = head("HTTP/1.1 204 No Content\r\n\r\n")
        .expect("valid")
        .expect("whole");
    assert_eq!(empty.framing, Framing::Length(0));
}

#[test]
fn informational_answers_are_skipped() {
    let text = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    let parsed = head(text).expect("valid").expect("whole");
    assert_eq!(parsed.status, 200);
    assert_eq!(&text[parsed.len..], "ok");
}

#[test]
fn bad_heads_are_errors() {
    assert!(matches!(
        head("NOT HTTP\r\n\r\n"),
        Err(FramingError::Head(_))
    ));
    assert_eq!(
        head("HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"),
        Err(FramingError::Length)
    );
    assert_eq!(
        head("HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n"),
        Err(FramingError::Length)
    );
    let endless = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD + 1));
    assert_eq!(head(&endless), Err(FramingError::HeadTooLarge));
}

/// Decodes `raw` (after a head of `start` bytes) arriving in pieces cut at `cuts`.
fn dechunk(
    raw: &[u8],
    start: usize,
    cuts: &[usize],
    limit: usize,
) -> Result<Vec<u8>, DechunkError> {
    let mut buffer = vec![b'h'; start];
    let mut chunks = Dechunker::new(start);
    let mut from = 0;
    for &cut in cuts.iter().chain(std::iter::once(&raw.len())) {
        buffer.extend_from_slice(&raw[from..cut]);
        from = cut;
        if let Some(end) = chunks.feed(&mut buffer, limit)? {
            assert_eq!(chunks.consumed(), start + cut, "nothing left over");
            assert!(
                buffer[..start].iter().all(|b| *b == b'h'),
                "the head is untouched"
            );
            return Ok(buffer[start..end].to_vec());
        }
    }
    panic!("incomplete")
}

const CHUNKED: &[u8] = b"5\r\nhello\r\n1;ext=1\r\n,\r\nA\r\n world!!!!\r\n0\r\ntrailer: x\r\n\r\n";

#[test]
fn a_chunked_body_decodes_in_place_however_it_arrives() {
    let whole = dechunk(CHUNKED, 40, &[], 1 << 20).expect("valid");
    assert_eq!(whole, b"hello, world!!!!");
    for cut in 0..CHUNKED.len() {
        assert_eq!(
            dechunk(CHUNKED, 40, &[cut], 1 << 20),
            Ok(whole.clone()),
            "cut at {cut}"
        );
    }
    let bytewise: Vec<usize> = (1..CHUNKED.len()).collect();
    assert_eq!(dechunk(CHUNKED, 0, &bytewise, 1 << 20), Ok(whole));
}

#[test]
fn a_chunked_body_over_the_limit_or_malformed_is_an_error() {
    assert_eq!(dechunk(CHUNKED, 0, &[], 8), Err(DechunkError::TooLarge));
    assert_eq!(
        dechunk(b"5\r\nhelloXX0\r\n\r\n", 0, &[], 100),
        Err(DechunkError::Malformed)
    );
    assert_eq!(
        dechunk(b"zz\r\n", 0, &[], 100),
        Err(DechunkError::Malformed)
    );
}
