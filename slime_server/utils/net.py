"""Small networking helpers shared by launchers and tests (ports, readiness polling)."""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import time

import httpx

from slime_server.utils.listeners import owns_listener

# SGLang's engines (SGLANG_TIMEOUT_KEEP_ALIVE, default 5 s) and ours (uvicorn's default, 5 s) close a connection
# idle that long. httpx keeps one idle for 5 s too: a call made just as the server closes it reuses a dead socket
# and fails with "connection reset by peer" (CI: a weight push's /pause_generation after an eval's 5 s pause).
# Clients that call engines at intervals drop idle connections well before the server does.
ENGINE_KEEP_ALIVE_S = 5
CLIENT_KEEPALIVE_EXPIRY_S = 2.0


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The default certificate-verifying TLS context, made once per process. httpx makes a new one for every client
    (and every top-level ``httpx.get``) it is not given one, loading the CA bundle each time: ~10-20 ms of CPU, so a
    loop polling a URL every 0.1 s spent a tenth of a core on TLS setup for plain-HTTP calls."""
    return httpx.create_ssl_context()


def engine_limits(max_connections: int | None = None) -> httpx.Limits:
    """Connection limits for a client of SGLang-style servers: idle connections expire before the server's; the
    pool holds ``max_connections`` (kept alive too), or httpx's default sizes."""
    if max_connections is None:
        return httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                        keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a free TCP port (racy by nature; callers bind promptly)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http_ok(url: str, timeout: float = 60.0, interval: float = 0.1, proc=None,
                 headers: dict[str, str] | None = None) -> None:
    """Poll ``url`` until it answers 2xx; raise TimeoutError (or RuntimeError if ``proc`` died).

    With ``proc``, a 2xx counts only once ``proc`` (or its session) listens on the URL's port: until then
    the answer is another process's, which took the port after it was chosen (utils/listeners.py)."""
    deadline = time.monotonic() + timeout
    last: str = ""
    port = httpx.URL(url).port
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} was ready")
        try:
            r = httpx.get(url, timeout=2.0, headers=headers, verify=tls_context())
            if r.status_code < 300:
                if proc is None or port is None or owns_listener(proc.pid, port) is not False:
                    return
                last = f"HTTP {r.status_code} from a process other than pid {proc.pid}"
            else:
                last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(interval)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s (last: {last})")


def is_loopback(host: str) -> bool:
    """True when ``host`` names only loopback addresses: a server bound there is reachable from this machine
    alone. ``0.0.0.0``/``::`` (every interface), a LAN address or a name that does not resolve are not."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


@functools.lru_cache(maxsize=64)
def is_local_host(host: str) -> bool:
    """True when ``host`` is an address of this machine (we can bind to it): shared memory is shared."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def address_towards(host: str, port: int = 80) -> str:
    """This machine's address on the route to ``host`` (what a peer there can reach us at); no packet
    is sent (a UDP socket's connect only picks the route)."""
    if is_local_host(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (``lo`` for 127.0.0.1), or None."""
    import fcntl
    import struct

    if ":" in address:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None
