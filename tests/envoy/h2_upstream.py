#!/usr/bin/env python3
"""An HTTP/2 upstream (cleartext, prior knowledge) for issue 48, and the bootstrap change that
puts it behind Envoy; asyncio and the `h2` package (tests/envoy/servers.sh's install_h2 puts it
in a venv of its own), 127.0.0.1 only.

  h2_upstream.py serve [--lifetime SECS]
      prints `listening on http://127.0.0.1:PORT`, then answers every request, once its end has
      arrived, with a HEADERS frame of :status N (the request's `x-status` header, default 204)
      and `content-type: text/event-stream` WITHOUT END_STREAM, then a DATA frame holding
      script.paced(3) (the marker frame included) with END_STREAM: a response that has no
      content by its status, followed by body bytes anyway (what an HTTP/2 server such as hyper's
      sends for a 204 or 304 whose body has bytes). The DATA frame is written as raw frame bytes
      (hyperframe), past h2's own state checks, so that it goes out whatever h2 thinks of it.
  h2_upstream.py fetch URL STATUS BODY
      (a client) one POST of BODY (JSON) with `x-status: STATUS` over HTTP/2 with prior knowledge
      to URL (Envoy); prints {"status", "headers", "data" (latin-1), "ended": the stream ended
      cleanly, "reset": the RST_STREAM error code or null, "error": a connection error or null}
  h2_upstream.py bootstrap FILE
      prints the Envoy bootstrap FILE (examples/envoy/*.yaml) with its `dynamo` cluster speaking
      HTTP/2 to the upstream (explicit_http_config: http2_protocol_options).
"""

import argparse
import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import script  # noqa: E402  (tests/envoy/script.py)

H2 = """\
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {}
"""


def bootstrap(path):
    """The bootstrap at `path` with the `dynamo` cluster on HTTP/2."""
    text = open(path).read()
    start = text.find("\n  - name: dynamo\n")
    end = text.find("\n  - name:", start + 1)
    end = len(text) if end == -1 else end
    line = "    connect_timeout: 5s\n"
    at = text.find(line, start, end)
    if start == -1 or at == -1:
        raise SystemExit(f"h2_upstream.py: {path} has no dynamo cluster with `connect_timeout: 5s`")
    at += len(line)
    return text[:at] + H2 + text[at:]


async def handle(reader, writer):
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    from hyperframe.frame import DataFrame

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    statuses = {}
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            try:
                events = conn.receive_data(data)
            except h2.exceptions.H2Error:  # about a stream h2 still thinks open: done with it
                return
            for event in events:
                if isinstance(event, h2.events.RequestReceived):
                    headers = dict(event.headers)
                    statuses[event.stream_id] = headers.get("x-status", "204")
                    if event.stream_ended:
                        respond(conn, writer, event.stream_id, statuses.pop(event.stream_id), DataFrame)
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if event.stream_ended:
                        respond(conn, writer, event.stream_id, statuses.pop(event.stream_id), DataFrame)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id in statuses:
                    respond(conn, writer, event.stream_id, statuses.pop(event.stream_id), DataFrame)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return
            writer.write(conn.data_to_send())
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def respond(conn, writer, stream_id, status, data_frame):
    """HEADERS without END_STREAM through h2, then the DATA frame as raw bytes."""
    conn.send_headers(stream_id, [(":status", status), ("content-type", "text/event-stream"),
                                  ("cache-control", "no-cache"), ("etag", '"sse"')])
    writer.write(conn.data_to_send())
    frame = data_frame(stream_id, b"".join(script.paced(3)), flags=["END_STREAM"])
    writer.write(frame.serialize())


async def fetch(url, status, body):
    """One HTTP/2 request (prior knowledge) and everything that came back on its stream."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    out = {"status": None, "headers": {}, "data": "", "ended": False, "reset": None, "error": None}
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except OSError as err:
        out["error"] = f"{type(err).__name__}: {err}"
        return out
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    data = body.encode()
    conn.send_headers(1, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
                          (":authority", parts.netloc), ("content-type", "application/json"),
                          ("content-length", str(len(data))), ("x-status", status)])
    conn.send_data(1, data, end_stream=True)
    writer.write(conn.data_to_send())
    got = b""
    try:
        while not (out["ended"] or out["reset"] is not None):
            chunk = await asyncio.wait_for(reader.read(65536), 15)
            if not chunk:
                out["error"] = "the connection closed"
                break
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    out["headers"] = dict(event.headers)
                    out["status"] = int(out["headers"].pop(":status"))
                elif isinstance(event, h2.events.DataReceived):
                    got += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    out["ended"] = True
                elif isinstance(event, h2.events.StreamReset):
                    out["reset"] = int(event.error_code)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    out["error"] = f"GOAWAY {event.error_code}"
            writer.write(conn.data_to_send())
            await writer.drain()
    except (asyncio.TimeoutError, ConnectionError, h2.exceptions.H2Error) as err:
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        writer.close()
    out["data"] = got.decode("latin-1")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["serve", "bootstrap", "fetch"])
    parser.add_argument("file", nargs="?", help="bootstrap: the bootstrap; fetch: the URL")
    parser.add_argument("status", nargs="?", default="204")
    parser.add_argument("body", nargs="?", default="{}")
    parser.add_argument("--lifetime", type=float, default=600)
    args = parser.parse_args()
    if args.mode == "bootstrap":
        sys.stdout.write(bootstrap(args.file))
    elif args.mode == "fetch":
        print(json.dumps(asyncio.run(fetch(args.file, args.status, args.body))))
    else:
        asyncio.run(script.serve(handle, args.lifetime))


if __name__ == "__main__":
    main()
