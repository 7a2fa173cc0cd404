"""``/docs`` with no network: the page and every file it loads come from leasekeeper
itself, never from another host, each with its own type and every answer's headers;
nothing else under ``/docs/`` is served; the files count under one route name."""

from __future__ import annotations

import importlib.util
import re
import socket
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._server import running_server
from tests.conftest import Api, metric

Get = Callable[[str], Any]

#: The type each thing the page loads must be served with: with nosniff, a browser runs
#: a script or applies a style sheet only under its own type.
TYPES = {
    "script": "text/javascript; charset=utf-8",
    "stylesheet": "text/css; charset=utf-8",
    "icon": "image/png",
    "a": "application/json",  # the <noscript> link to the description
}


class Page(HTMLParser):
    """Every URL the page names, with what names it, and its inline scripts and styles."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str]] = []
        self.inline: list[str] = []
        self._tag = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self._tag = tag
        if "style" in found or tag == "style":
            self.inline.append(f"style on <{tag}>")
        if tag == "script" and not found.get("src"):
            self.inline.append("a script without src")
        for name in ("src", "href"):
            if (url := found.get(name)) is not None:
                kind = found.get("rel") if tag == "link" else tag
                self.urls.append((kind or tag, url))

    def handle_data(self, data: str) -> None:
        if self._tag == "script" and data.strip():
            self.inline.append(f"script text {data.strip()[:40]!r}")

    def handle_endtag(self, tag: str) -> None:
        self._tag = ""


def package_file(name: str) -> bytes:
    """One of Swagger UI's files as the installed package ships it."""
    spec = importlib.util.find_spec("flask_swagger_ui")
    assert spec is not None and spec.submodule_search_locations
    return (Path(next(iter(spec.submodule_search_locations))) / "dist" / name).read_bytes()


def assert_served_whole(get: Get) -> list[str]:
    """``/docs`` fetched with ``get`` (a path -> response), and every file it names fetched
    from the same server: each 200, with its type and the headers every answer has; no
    URL in the page or its style sheet points at another host. Returns the paths."""
    response = get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    html = response.text
    assert not re.search(r"https?:|//", html), html  # no URL with a host, of any scheme
    header = response.headers["content-security-policy"]
    policy = {
        name: value for name, _, value in (part.partition(" ") for part in header.split("; "))
    }
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == policy["style-src"] == policy["connect-src"] == "'self'"
    assert policy["img-src"] == "'self' data:"
    page = Page()
    page.feed(html)
    assert page.inline == []  # the policy runs no inline script or style
    kinds = sorted(kind for kind, _ in page.urls)
    assert kinds == ["a", "icon", "script", "script", "stylesheet"], page.urls
    paths = []
    for kind, url in page.urls:
        assert re.fullmatch(r"/[\w./-]+", url) and ".." not in url, url  # this server's
        served = get(url)
        assert served.status_code == 200, url
        assert served.headers["content-type"] == TYPES[kind], url
        assert served.headers["cache-control"] == "no-store", url
        assert served.headers["x-content-type-options"] == "nosniff", url
        assert int(served.headers["content-length"]) == len(served.content), url
        paths.append(url)
        if kind == "stylesheet":
            css = served.text
            assert "@import" not in css
            for ref in re.findall(r"url\(\s*['\"]?([^'\")]*)", css):
                assert ref.startswith("data:"), ref  # inline: nothing fetched, from anywhere
            # The package's file, less its trailing comment naming a map it does not ship.
            shipped = package_file("swagger-ui.css")
            assert shipped.startswith(served.content.rstrip()), url
            assert len(shipped) - len(served.content) < 100, url
        if url.endswith(".js"):
            assert "sourceMappingURL" not in served.text[-500:], url  # no map to ask for
    bundle = get("/docs/swagger-ui-bundle.js").content
    assert bundle == package_file("swagger-ui-bundle.js")  # Swagger UI's, byte for byte
    assert b"SwaggerUIBundle" in get("/docs/init.js").content
    return paths


def test_the_page_and_everything_it_loads_come_from_the_app(api: Api) -> None:
    """In process: the page and each file it names, as the section above asks."""
    assert_served_whole(api.client.get)


def test_the_asset_files_count_under_one_route_name(api: Api) -> None:
    """The files /docs loads are the route "docs_asset" in the metrics and the log; any
    other path under /docs/ is "other", so no path a client makes up becomes a label."""
    paths = assert_served_whole(api.client.get)
    assets = [path for path in paths if path.startswith("/docs/")]
    assert len(assets) == 4  # the style sheet, the icon, Swagger UI and its start
    made_up = ["/docs/secret-ns_abc", "/docs/swagger-ui.js", "/docs/init.js/x"]
    for path in made_up:
        assert api.client.get(path).status_code == 404
    text = api.client.get("/metrics").text
    counted = metric(text, "leasekeeper_requests_total", route="docs_asset", status="200")
    assert counted == len(assets) + 2  # the bundle and init.js fetched again by the check
    assert metric(text, "leasekeeper_requests_total", route="docs", status="200") == 1
    assert metric(text, "leasekeeper_requests_total", route="other", status="404") == 3
    labels = set(re.findall(r'route="([^"]*)"', text))
    assert not any("/" in label or "secret" in label for label in labels), labels


@pytest.mark.slow
def test_a_real_server_serves_the_page_whole_and_nothing_else_under_docs(
    tmp_path: Path,
) -> None:
    """``leasekeeper serve``: the page and its files as above; then a path that climbs out
    (``..``, plain, percent-encoded, with encoded slashes or backslashes), a file the
    package ships that the page does not load, and a name never served: each 404
    not_found, sent raw so that no client tidies the path first."""
    with running_server("memory", tmp_path / "server.log") as server:
        with httpx.Client(base_url=server.url) as client:
            assert_served_whole(client.get)
        port = int(server.url.rsplit(":", 1)[1])
        for path in (
            "/docs/../pyproject.toml",
            "/docs/../../../../etc/passwd",
            "/docs/..%2F..%2Fpyproject.toml",
            "/docs/%2e%2e/%2e%2e/etc/passwd",
            "/docs/%2E%2E%2F%2E%2E%2Fetc%2Fpasswd",
            "/docs/..%5C..%5Cpyproject.toml",
            "/docs/%2Fetc%2Fpasswd",
            "/docs//etc/passwd",
            "/docs/./swagger-ui.css",
            "/docs/dist/swagger-ui.css",
            "/docs/swagger-ui.css.map",
            "/docs/swagger-ui.js",
            "/docs/oauth2-redirect.html",
            "/docs/index.css",
            "/docs/LICENSE",
            "/docs/VERSION",
            "/docs/flask_swagger_ui.py",
            "/docs/nothing.js",
            "/docs/swagger-ui.css/x",
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
                )
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404 "), (path, head)
            assert b'"status":"not_found"' in body, (path, body)
        assert "Traceback" not in server.log.read_text()
