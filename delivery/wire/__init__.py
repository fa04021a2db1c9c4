"""Our own HTTP/1.1 wire for webhook POSTs: asyncio protocols and httptools' parser.

Why: on a drain to an instant receiver, aiohttp's request path was a quarter to a
third of the worker's CPU (docs/performance-history.md: where the time goes), as much per
request as the whole raw-ceiling client spends. A webhook POST needs little of a
general client: one request per connection at a time, keep-alive, an egress proxy,
and none of redirects, cookies, compression, auth or streaming uploads. This wire
writes each request as one buffer and parses the answer with httptools (llhttp,
the parser of Node.js and uvicorn), in C.

It keeps what httpx's own pool guarantees (tests/delivery/test_transport.py runs every case
through both):

- the SSRF guard: names are resolved once and every answer checked
  (`GuardedResolver`), IP literals are checked as they are, and the checked address
  is what is dialled; TLS still verifies and sends SNI for the URL's host;
- a name's addresses are raced (Happy Eyeballs, RFC 8305), so one that drops
  packets costs a 250 ms stagger, not the attempt's whole deadline;
- through a proxy, the same guard first: HTTPS tunnels (`CONNECT`) to the checked
  address, plain HTTP names it in absolute form;
- the scheme rule (`https_only`);
- the failure mapping, into the httpx classes `delivery.http.send_attempt` turns
  into outcomes: connect failures are `ConnectError` / `ConnectTimeout` (nothing was
  sent), a connection lost or a malformed answer after sending is
  `RemoteProtocolError` / `ReadError` (it may have arrived);
- the progress callback (`trace`) fires when the request starts going out, so
  shutdown can tell queued attempts from started ones;
- a response body not read to its end closes the connection instead of reusing it.

What it trusts (tests/delivery/test_wire_defects.py, tests/delivery/test_proxy_reuse.py,
and tests/delivery/test_wire_fuzz.py against h11):
a response counts only when it was parsed to its end; a connection goes back to the
pool only when nothing at all followed that end, the server keeps it alive and speaks
HTTP/1.1 (a forward proxy's plain-HTTP connection: only when it says `keep-alive`), and
is written onto again only when its socket shows no close received meanwhile; the
head, the trailers (dropped, never merged into the headers) and the bytes between body
bytes are bounded; a discarded connection is aborted, so nothing it still had to send
stays buffered.
"""

from delivery.wire.connect import CONNECT_STAGGER_SECONDS
from delivery.wire.connection import KEEPALIVE_EXPIRY, MAX_HEAD_BYTES, WireResponse
from delivery.wire.transport import IDENTITY_EXTENSION, PROXY_EXTENSION, Trace, WireTransport

__all__ = [
    "CONNECT_STAGGER_SECONDS",
    "IDENTITY_EXTENSION",
    "KEEPALIVE_EXPIRY",
    "MAX_HEAD_BYTES",
    "PROXY_EXTENSION",
    "Trace",
    "WireResponse",
    "WireTransport",
]
