//! A stream held in memory, with Envoy's buffer semantics: the host of the per-stream layer's
//! tests and of the fuzz target, which drive [`StreamFilter`] without Envoy.

use http::{HeaderMap, HeaderName};

use super::{
    append_header_values, Body, BodyStatus, Headers, HeadersStatus, Host, Level, StreamFilter,
    TrailersStatus,
};
use crate::config::FilterConfig;
use crate::metrics::Counter;

/// One stream as Envoy holds it, and what left it.
#[derive(Debug, Default)]
pub struct MemoryHost {
    /// The request's headers.
    pub request_headers: Vec<(String, Vec<u8>)>,
    /// The response's headers.
    pub response_headers: Vec<(String, Vec<u8>)>,
    /// Each body buffer as slices: `[received request, buffered request, received response,
    /// buffered response]`.
    pub bodies: [Vec<Vec<u8>>; 4],
    /// What went upstream (the request body).
    pub upstream: Vec<u8>,
    /// What went to the client (the response body).
    pub client: Vec<u8>,
    /// The local reply: status and body.
    pub sent: Option<(u16, Vec<u8>)>,
    /// The reset's details, if the stream was reset.
    pub reset: Option<String>,
    /// Counter increments: counter, label, value.
    pub counts: Vec<(Counter, String, u64)>,
    /// Log lines.
    pub logs: Vec<(Level, String)>,
    /// Calls that change the stream.
    pub mutations: usize,
    /// The received request chunk is the buffered request body (an earlier filter buffered it):
    /// both names reach `bodies[1]`, as in Envoy.
    pub received_is_buffered: bool,
}

/// A request head as a fake stream holds it: `:method` first, then these headers. Shared with the
/// proxy-wasm plugin's fake host.
pub fn request_head(method: &str, headers: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    std::iter::once((":method", method))
        .chain(headers.iter().copied())
        .map(|(name, value)| (name.to_owned(), value.as_bytes().to_vec()))
        .collect()
}

fn index(body: Body) -> usize {
    match body {
        Body::ReceivedRequest => 0,
        Body::BufferedRequest => 1,
        Body::ReceivedResponse => 2,
        Body::BufferedResponse => 3,
    }
}

impl MemoryHost {
    /// The buffer a name reaches: the received request chunk is the buffered body when an earlier
    /// filter buffered it.
    fn slot(&self, body: Body) -> usize {
        if body == Body::ReceivedRequest && self.received_is_buffered {
            index(Body::BufferedRequest)
        } else {
            index(body)
        }
    }

    fn list(&self, headers: Headers) -> &Vec<(String, Vec<u8>)> {
        match headers {
            Headers::Request => &self.request_headers,
            Headers::Response => &self.response_headers,
        }
    }

    /// The total counted for a counter's series.
    pub fn count(&self, counter: Counter, label: &str) -> u64 {
        self.counts
            .iter()
            .filter(|(c, l, _)| *c == counter && l == label)
            .map(|(_, _, n)| n)
            .sum()
    }

    /// The first value of a header.
    pub fn header(&self, headers: Headers, name: &str) -> Option<&[u8]> {
        self.list(headers)
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
    }
}

impl Host for MemoryHost {
    fn headers(&self, headers: Headers, name: &HeaderName, into: &mut HeaderMap) -> bool {
        let values = self
            .list(headers)
            .iter()
            .filter(|(key, _)| key == name.as_str())
            .map(|(_, value)| value.as_slice());
        append_header_values(name, values, into)
    }

    fn value(&self, headers: Headers, name: &str) -> Option<Vec<u8>> {
        self.header(headers, name).map(<[u8]>::to_vec)
    }

    fn set_header(&mut self, headers: Headers, name: &str, value: Option<&[u8]>) -> bool {
        self.mutations += 1;
        let list = match headers {
            Headers::Request => &mut self.request_headers,
            Headers::Response => &mut self.response_headers,
        };
        list.retain(|(k, _)| k != name);
        if let Some(value) = value {
            list.push((name.to_owned(), value.to_vec()));
        }
        true
    }

    fn received_request_is_buffered(&self) -> bool {
        self.received_is_buffered
    }

    fn body_len(&self, body: Body) -> usize {
        self.bodies[self.slot(body)].iter().map(Vec::len).sum()
    }

    fn with_body<R>(&self, body: Body, f: impl FnOnce(&[&[u8]]) -> R) -> R {
        let slices: Vec<&[u8]> = self.bodies[self.slot(body)]
            .iter()
            .map(Vec::as_slice)
            .filter(|s| !s.is_empty())
            .collect();
        f(&slices)
    }

    fn drain_body(&mut self, body: Body, mut n: usize) -> bool {
        self.mutations += 1;
        let slot = self.slot(body);
        let slices = &mut self.bodies[slot];
        while n > 0 && !slices.is_empty() {
            let take = n.min(slices[0].len());
            slices[0].drain(..take);
            n -= take;
            if slices[0].is_empty() {
                slices.remove(0);
            }
        }
        true
    }

    fn append_body(&mut self, body: Body, data: &[u8]) -> bool {
        self.mutations += 1;
        let slot = self.slot(body);
        self.bodies[slot].push(data.to_vec());
        true
    }

    fn send_response(&mut self, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
        assert_eq!(headers, [("content-type", &b"application/json"[..])]);
        assert!(self.sent.is_none(), "two local replies");
        self.sent = Some((status, body.to_vec()));
    }

    fn reset_stream(&mut self, details: &str) {
        self.reset = Some(details.to_owned());
    }

    fn increment(&mut self, counter: Counter, label: &str, value: u64) {
        self.counts.push((counter, label.to_owned(), value));
    }

    fn log(&mut self, level: Level, message: &str) {
        self.logs.push((level, message.to_owned()));
    }
}

/// A filter and its stream, driven as Envoy drives them: buffers moved as Envoy moves them
/// after each status.
#[derive(Debug)]
pub struct SimulatedStream {
    /// The filter under test.
    pub filter: StreamFilter,
    /// Its stream.
    pub fake: MemoryHost,
}

impl SimulatedStream {
    /// A new stream under this configuration.
    pub fn new(config: &FilterConfig) -> Self {
        Self {
            filter: StreamFilter::new(config),
            fake: MemoryHost::default(),
        }
    }

    /// A new stream under the default configuration (the Dynamo preset).
    pub fn dynamo() -> Self {
        Self::new(&FilterConfig::parse(b"").unwrap())
    }

    /// The request's head (`:method` and these headers).
    pub fn request(
        &mut self,
        method: &str,
        headers: &[(&str, &str)],
        end_of_stream: bool,
    ) -> HeadersStatus {
        self.fake.request_headers = request_head(method, headers);
        self.filter
            .on_request_headers(&mut self.fake, end_of_stream)
    }

    /// A request chunk: Envoy keeps it (StopIterationAndBuffer), forwards it and what it buffered
    /// (Continue), or drops it.
    pub fn request_chunk(&mut self, chunk: &[u8], end_of_stream: bool) -> BodyStatus {
        self.fake.bodies[0] = vec![chunk.to_vec()];
        let status = self.filter.on_request_body(&mut self.fake, end_of_stream);
        let received = std::mem::take(&mut self.fake.bodies[0]);
        match status {
            BodyStatus::StopIterationAndBuffer => self.fake.bodies[1].extend(received),
            BodyStatus::Continue => {
                for slice in std::mem::take(&mut self.fake.bodies[1])
                    .into_iter()
                    .chain(received)
                {
                    self.fake.upstream.extend_from_slice(&slice);
                }
            }
            BodyStatus::StopIterationNoBuffer => {}
        }
        status
    }

    /// The whole request body as a filter before this one buffered it (`envoy.filters.http.buffer`,
    /// a Lua `body()`): Envoy hands the buffered body on as the received chunk, in these slices;
    /// on Continue it goes upstream.
    pub fn request_buffered_before(&mut self, slices: &[&[u8]], end_of_stream: bool) -> BodyStatus {
        self.fake.bodies[1] = slices.iter().map(|s| s.to_vec()).collect();
        self.fake.received_is_buffered = true;
        let status = self.filter.on_request_body(&mut self.fake, end_of_stream);
        self.fake.received_is_buffered = false;
        if status == BodyStatus::Continue {
            for slice in std::mem::take(&mut self.fake.bodies[1]) {
                self.fake.upstream.extend_from_slice(&slice);
            }
        }
        status
    }

    /// The request's trailers: on Continue, the buffered body goes upstream.
    pub fn request_trailers(&mut self) -> TrailersStatus {
        let status = self.filter.on_request_trailers(&mut self.fake);
        if status == TrailersStatus::Continue {
            for slice in std::mem::take(&mut self.fake.bodies[1]) {
                self.fake.upstream.extend_from_slice(&slice);
            }
        }
        status
    }

    /// The response's head.
    pub fn response(&mut self, headers: &[(&str, &str)], end_of_stream: bool) -> HeadersStatus {
        self.fake.response_headers = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect();
        self.filter
            .on_response_headers(&mut self.fake, end_of_stream)
    }

    /// A `200 text/event-stream` response head.
    pub fn sse(&mut self) -> HeadersStatus {
        self.response(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        )
    }

    /// A response chunk, in Envoy's slices; on Continue what the received buffer holds then goes
    /// to the client.
    pub fn response_chunk(&mut self, slices: &[&[u8]], end_of_stream: bool) -> BodyStatus {
        self.fake.bodies[2] = slices.iter().map(|s| s.to_vec()).collect();
        let status = self.filter.on_response_body(&mut self.fake, end_of_stream);
        let received = std::mem::take(&mut self.fake.bodies[2]);
        if status == BodyStatus::Continue {
            for slice in received {
                self.fake.client.extend_from_slice(&slice);
            }
        }
        status
    }

    /// The response's trailers: what the filter appended goes to the client first.
    pub fn response_trailers(&mut self) -> TrailersStatus {
        let status = self.filter.on_response_trailers(&mut self.fake);
        for slice in std::mem::take(&mut self.fake.bodies[3]) {
            self.fake.client.extend_from_slice(&slice);
        }
        status
    }

    /// The end of the stream.
    pub fn complete(&mut self) {
        self.filter.on_stream_complete(&mut self.fake);
    }
}

/// What the per-stream suites (the adapter's and the proxy-wasm plugin's) drive streams with.
pub mod fixtures {
    /// The router's marker frame, removed for a client that did not opt in.
    pub const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
    /// A data frame, always forwarded.
    pub const DATA: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
    /// An annotation frame a client may opt in to.
    pub const REQUEST_ID: &[u8] = b"event: request_id\ndata: \"r-1\"\n\n";
    /// A JSON request head the guard cannot read (its body is encoded).
    pub const GZIPPED_JSON: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("content-encoding", "gzip"),
    ];

    /// An event stream with a marker before and after the frames that go on.
    pub fn stream_body() -> Vec<u8> {
        [MARKER, REQUEST_ID, DATA, MARKER, b"data: [DONE]\n\n"].concat()
    }
}
