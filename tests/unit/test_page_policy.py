"""The web pages' Content-Security-Policy (ddm.serving.http.server.page_headers) admits exactly the
page's own inline script and style elements, by the SHA-256 of the text a browser hashes, however
the page's comments and strings mention tags: known answers, written out by hand."""

from __future__ import annotations

import base64
import hashlib

from ddm.serving.http.server import page_headers

SCRIPT = '\nconst end = "</div>"; // <style> in a string\n'
STYLE = "\n  [hidden] { display: none !important; }\n"
PAGE = f"""<!doctype html>
<!-- The page's own <script> and <style> are hashed; this comment is not. -->
<html><head><style>{STYLE}</style>
<script src="/elsewhere.js"></script></head>
<body><p>a &lt;script&gt; in text</p><script>{SCRIPT}</script></body></html>"""


def _hash(text: str) -> str:
    return f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"


def test_the_policy_admits_the_inline_elements_and_nothing_a_comment_mentions():
    policy = dict(d.strip().split(" ", 1) for d in
                  page_headers(PAGE)["Content-Security-Policy"].split(";"))
    assert policy["script-src"].split() == [_hash(SCRIPT)]  # not the src one, not the comment
    assert policy["style-src"].split() == [_hash(STYLE)]
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"


def test_other_sources_are_added_to_the_hashes():
    policy = page_headers(PAGE, sources=("https://cdn.example",))["Content-Security-Policy"]
    assert f"script-src {_hash(SCRIPT)} https://cdn.example;" in policy
