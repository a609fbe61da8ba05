"""`expertmesh hub` speaks the Hub protocol as the real huggingface_hub client uses it."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, HfFileSystem, hf_hub_download
from huggingface_hub import errors as hf_errors
from repos import KIMI_K3

from expertmesh.devtools.link_emulation import TokenBucket, reserve_together
from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.node.fetching import FetchContext


def test_hf_hub_download_small_and_lfs(hub: HubServer, tiny_repos: dict[str, Path], tmp_path: Path) -> None:
    repo = tiny_repos["kimi_k3"]
    for name in ("config.json", "model-00002-of-00003.safetensors"):
        path = hf_hub_download(KIMI_K3, name, cache_dir=tmp_path, endpoint=hub.url)
        assert Path(path).read_bytes() == (repo / name).read_bytes()
    info = HfApi(endpoint=hub.url).model_info(KIMI_K3)
    assert len(info.sha) == 40 and "config.json" in {s.rfilename for s in info.siblings}
    path = hf_hub_download(KIMI_K3, "config.json", revision=info.sha, cache_dir=tmp_path / "b", endpoint=hub.url)
    assert Path(path).read_bytes() == (repo / "config.json").read_bytes()


def test_get_safetensors_metadata(hub: HubServer) -> None:
    meta = HfApi(endpoint=hub.url).get_safetensors_metadata(KIMI_K3)
    t = meta.files_metadata[meta.weight_map["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]]
    info = t.tensors["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    assert info.dtype == "U8" and info.shape == [64, 16]


def test_hf_file_system_range_read(hub: HubServer, tiny_repos: dict[str, Path]) -> None:
    fs = HfFileSystem(endpoint=hub.url)
    name = "model-00001-of-00003.safetensors"
    with fs.open(f"{KIMI_K3}/{name}", "rb") as f:
        f.seek(1000)
        data = f.read(500)
    assert data == (tiny_repos["kimi_k3"] / name).read_bytes()[1000:1500]


def test_ranges_and_errors(hub: HubServer, tiny_repos: dict[str, Path]) -> None:
    url = f"{hub.url}/{KIMI_K3}/resolve/main/config.json"
    body = (tiny_repos["kimi_k3"] / "config.json").read_bytes()
    r = httpx2.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == body[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{len(body)}"
    r = httpx2.get(url, headers={"Range": "bytes=-5"})
    assert r.status_code == 206 and r.content == body[-5:]
    r = httpx2.get(url, headers={"Range": f"bytes={len(body) + 5}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(body)}"
    assert httpx2.get(url).status_code == 200
    r = httpx2.head(f"{hub.url}/{KIMI_K3}/resolve/main/model-00001-of-00003.safetensors")
    assert r.status_code == 302 and "x-linked-size" in r.headers and "x-repo-commit" in r.headers
    api = HfApi(endpoint=hub.url)
    with pytest.raises(hf_errors.RepositoryNotFoundError):
        api.model_info("expertmesh/nope")
    with pytest.raises(hf_errors.RevisionNotFoundError):
        api.model_info(KIMI_K3, revision="nope")
    with pytest.raises(hf_errors.EntryNotFoundError):
        hf_hub_download(KIMI_K3, "missing.txt", endpoint=hub.url)


def test_faults_and_stats(hub: HubServer) -> None:
    url = f"{hub.url}/{KIMI_K3}/resolve/main/config.json"
    hub.knobs.faults = [Fault("429", count=2, retry_after_s=3)]
    assert [httpx2.get(url).status_code for _ in range(3)] == [429, 429, 200]
    hub.knobs.faults = [Fault("wrong_bytes", count=1)]
    a, b = httpx2.get(url), httpx2.get(url)
    assert len(a.content) == len(b.content) and a.content != b.content
    httpx2.post(f"{hub.url}/_hub/stats/reset")
    httpx2.post(f"{hub.url}/_hub/knobs", json={"faults": [{"kind": "503", "count": 1}]})
    assert httpx2.get(url).status_code == 503
    httpx2.get(url, headers={"Range": "bytes=0-9"})
    stats = httpx2.get(f"{hub.url}/_hub/stats").json()
    assert stats["faults"] == {"503": 1}
    assert stats["files"][f"{KIMI_K3}/config.json"]["ranges"] == [[0, 9, 1]]


def test_bandwidth_is_a_lower_bound(hub: HubServer) -> None:
    hub.knobs.faults = []
    hub.knobs.bandwidth_bytes_per_s = 500_000
    try:
        t = time.monotonic()
        r = httpx2.get(f"{hub.url}/{KIMI_K3}/resolve/main/model-00001-of-00003.safetensors", follow_redirects=True)
        elapsed = time.monotonic() - t
    finally:
        hub.knobs.bandwidth_bytes_per_s = 0
    assert elapsed >= 0.8 * len(r.content) / 500_000


def test_a_connection_pays_its_own_rate_not_the_link_on_top() -> None:
    """Eight connections of an eighth of the link each fill it: a chunk holds the link for its
    share only. Checked at chosen instants (all calls at t = 0), so no scheduling delay enters."""
    link, conn, other = TokenBucket(), TokenBucket(), TokenBucket()
    for bucket in (link, conn, other):
        bucket._next_free = 0.0
    wait = reserve_together(8, 0.0, (link, 8e6), (conn, 1e6))  # 1 µs of the link, 8 µs of the connection
    assert wait == pytest.approx(8e-6)
    assert (link._next_free, conn._next_free) == (pytest.approx(1e-6), pytest.approx(8e-6))
    wait = reserve_together(8, 0.0, (link, 8e6), (other, 1e6))  # a second connection starts when the link is free
    assert other._next_free == pytest.approx(1e-6 + 8e-6)  # not after the first connection's end
    assert link._next_free == pytest.approx(2e-6)
    assert wait == pytest.approx(9e-6)


@pytest.mark.e2e
def test_cli_serves_and_stops(hub_root: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "expertmesh", "hub", str(hub_root), "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("expertmesh hub: serving")
        url = line.rsplit(" at ", 1)[1].strip()
        assert httpx2.get(f"{url}/_hub/health").json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fault_flags_parse_or_fail_clearly() -> None:
    import argparse

    from expertmesh.devtools.local_hub import parse_fault

    f = parse_fault("cut:count=2,path=*.safetensors")
    assert (f.kind, f.count, f.path_glob) == ("cut", 2, "*.safetensors")
    assert parse_fault("429:rate=0.5,retry_after=2").retry_after_s == 2.0
    for bad in ("bogus:rate=1", "cut:speed=3", "cut:count=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_fault(bad)


def test_a_large_file_is_served_by_range_and_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror of a multi-GB checkpoint: start-up and range reads never read whole files, a large
    file's sha256 is computed once (in the background) and kept across restarts, and until then
    its ETag is a provisional id that huggingface_hub still accepts."""
    from expertmesh.devtools import local_hub

    repo = tmp_path / "hub" / "big" / "model"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text('{"model_type": "none"}')
    shard = repo / "model-00001-of-00001.safetensors"
    size = local_hub._SMALL_HASH_BYTES + 5 * 1024 * 1024  # large: hashed in the background only
    with open(shard, "wb") as f:
        f.truncate(size)  # sparse: costs no disk
        f.seek(size - 1000)
        f.write(bytes(range(200)))
    hashed: list[Path] = []
    real_sha256_of = local_hub._sha256_of
    monkeypatch.setattr(local_hub, "_sha256_of", lambda p: hashed.append(p) or real_sha256_of(p))

    with HubServer(tmp_path / "hub", hash_in_background=False) as hub:
        url = f"{hub.url}/big/model/resolve/main/{shard.name}"
        head = httpx2.head(url)
        provisional = head.headers["x-linked-etag"].strip('"')
        assert head.status_code == 302 and len(provisional) == 64
        r = httpx2.get(url, headers={"Range": f"bytes={size - 1000}-{size - 801}"}, follow_redirects=True)
        assert r.status_code == 206 and r.content == bytes(range(200))
        assert not hashed  # neither start-up nor a range read hashed the shard
        hub.digests.hash_all(hub.large_files())
        assert hashed == [shard]
        sha = hashlib.sha256(shard.read_bytes()).hexdigest()
        assert httpx2.head(url).headers["x-linked-etag"].strip('"') == sha != provisional
    with HubServer(tmp_path / "hub", hash_in_background=False) as again:
        assert httpx2.head(f"{again.url}/big/model/resolve/main/{shard.name}").headers["x-linked-etag"] == f'"{sha}"'
    assert hashed == [shard]  # kept in .hub_cache/digests.json: not hashed again after a restart


def test_a_read_that_may_give_up_stops_mid_transfer_but_finishes_what_is_nearly_done(tmp_path: Path) -> None:
    """A fetch nobody waits for gives its link up to a demand: the read stops between chunks
    (the Hub sends far less than asked), unless less than ABANDON_MIN_LEFT_BYTES is left."""
    from expertmesh.node.errors import Abandoned
    from expertmesh.node.hub import client as hub_client

    repo = tmp_path / "hub" / "big" / "model"
    repo.mkdir(parents=True)
    (repo / "model.safetensors").write_bytes(bytes(range(256)) * (32 * 1024))  # 8 MiB
    with HubServer(tmp_path / "hub") as hub, hub_client.using_endpoint(hub.url):
        hub.knobs.bandwidth_bytes_per_s = 4e6  # 8 MiB takes 2 s
        reader = hub_client.RangeReader()
        remote = hub_client.RemoteFile("big/model", hub.repos["big/model"].commit, "model.safetensors")
        want = 8 * 1024 * 1024
        buf = memoryview(bytearray(want))
        flag = threading.Event()
        threading.Timer(0.2, flag.set).start()
        with pytest.raises(Abandoned):
            reader.read_into(remote, 0, want, buf, FetchContext(abandon=flag.is_set))
        assert hub.stats()["bytes_served"] < want // 2  # it stopped, it did not finish
        small = hub_client.ABANDON_MIN_LEFT_BYTES * 9 // 10
        flag.clear()
        threading.Timer(0.05, flag.set).start()
        assert (
            reader.read_into(remote, 0, small, buf, FetchContext(abandon=flag.is_set)) == small
        )  # nearly done: finished
        assert bytes(buf[:small]) == (bytes(range(256)) * (32 * 1024))[:small]
        # asked to give up before it starts: a small read is not worth giving up either (a small
        # model's guesses and fills were all thrown away so, and the demo's cold decode kept the
        # link 0.75 busy instead of 0.95); a big one asks nothing of the Hub
        flag.set()
        served = hub.stats()["bytes_served"]
        assert reader.read_into(remote, 0, small, buf, FetchContext(abandon=flag.is_set)) == small
        with pytest.raises(Abandoned):
            reader.read_into(remote, 0, want, buf, FetchContext(abandon=flag.is_set))
        assert hub.stats()["bytes_served"] == served + small


def _raw(port: int, method: str, path: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, bytes]:
    """One request with exactly these headers (httpx2 would fix a bad Content-Length itself)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders(body or None)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_hub_routes_need_the_token_never_show_it_and_cannot_drop_it(hub_root: Path) -> None:
    from expertmesh.devtools.local_hub import HubKnobs

    token = "hf_secret_test_token"
    auth = {"Authorization": f"Bearer {token}"}
    with HubServer(hub_root, knobs=HubKnobs(required_token=token)) as server:
        for method, path in [
            ("GET", "/_hub/knobs"),
            ("GET", "/_hub/stats"),
            ("GET", "/_hub/health"),
            ("POST", "/_hub/knobs"),
            ("POST", "/_hub/stats/reset"),
        ]:
            assert httpx2.request(method, f"{server.url}{path}", json={}).status_code == 401, path
            wrong = {"Authorization": "Bearer hf_wrong"}
            assert httpx2.request(method, f"{server.url}{path}", json={}, headers=wrong).status_code == 401, path
        r = httpx2.get(f"{server.url}/_hub/knobs", headers=auth)
        assert r.status_code == 200 and token not in r.text and r.json()["token_required"] is True
        for doc in ({"required_token": None}, {"required_token": "other"}):
            r = httpx2.post(f"{server.url}/_hub/knobs", json=doc, headers=auth)
            assert r.status_code == 400 and token not in r.text
        assert server.knobs.required_token == token
        assert httpx2.get(f"{server.url}/api/models/{KIMI_K3}").status_code == 401
        assert httpx2.get(f"{server.url}/api/models/{KIMI_K3}", headers=auth).status_code == 200
        r = httpx2.post(f"{server.url}/_hub/knobs", json={"ttfb_s": 0.0}, headers=auth)
        assert r.status_code == 200 and token not in r.text


@pytest.mark.parametrize("length", ["-5", "abc", "1e3", "99999999999999999999", "0x10"])
def test_a_bad_content_length_gets_a_400(hub: HubServer, length: str) -> None:
    status, _ = _raw(hub.port, "POST", "/_hub/knobs", {"Content-Length": length})
    assert status == 400


@pytest.mark.parametrize(
    "doc",
    [
        {"ttfb_s": "1"},
        {"ttfb_s": -1},
        {"bandwidth_bytes_per_s": True},
        {"seed": 1.5},
        {"faults": [{"kind": "bogus"}]},
        {"faults": [{"kind": "503", "rate": "x"}]},
        {"faults": "503"},
        {"no_such_knob": 1},
        [1, 2],
    ],
)
def test_malformed_knobs_get_a_400_and_change_nothing(hub: HubServer, doc: object) -> None:
    before = dict(hub.knobs.public())
    r = httpx2.post(f"{hub.url}/_hub/knobs", json=doc)
    assert r.status_code == 400
    assert hub.knobs.public() == before


def test_cdn_urls_are_signed_by_the_hub_and_expire(
    tiny_repos: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private repo (`.hub_private`) is served only through a CDN URL the Hub signed after the
    token check: a forged, altered or expired URL gets a 403, and a malformed one never a traceback."""
    import base64
    import json
    import shutil
    import urllib.parse

    from expertmesh.node.hub import client as hub_client

    repo = tmp_path / "hub" / "expertmesh" / "tiny-kimi_k3"
    shutil.copytree(tiny_repos["kimi_k3"], repo)
    (repo / ".hub_commit").write_text("0123456789abcdef0123456789abcdef01234567")  # a public upstream commit
    (repo / ".hub_private").write_text("hf_private")
    name = "model-00001-of-00003.safetensors"
    original = (repo / name).read_bytes()

    def cdn(doc: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()

    with HubServer(tmp_path / "hub") as server:
        commit = server.repos[KIMI_K3].commit
        cdn_at = server.cdn_url_base
        assert cdn_at != server.url  # another origin: the signed URL is the credential there, never a token
        rng = {"Range": "bytes=0-1023"}
        assert httpx2.get(f"{server.url}/{KIMI_K3}/resolve/main/{name}", headers=rng).status_code == 401
        key = "Key-Pair-Id=KEXPERTMESH0000"
        forged = f"{cdn_at}/_cdn/{cdn([KIMI_K3, commit, name])}?Expires=99999999999&{key}"
        assert httpx2.get(forged, headers=rng).status_code == 403
        assert httpx2.get(forged + "&Signature=" + "0" * 64, headers=rng).status_code == 403
        assert httpx2.get(f"{server.url}/_cdn/{cdn([KIMI_K3, commit, name])}").status_code == 404  # not on the Hub

        auth = {**rng, "Authorization": "Bearer hf_private"}
        location = httpx2.get(f"{server.url}/{KIMI_K3}/resolve/main/{name}", headers=auth).headers["location"]
        assert location.startswith(cdn_at + "/")
        r = httpx2.get(location, headers=rng)  # no token: the signature is the credential
        assert r.status_code == 206 and r.content == original[:1024]
        url = urllib.parse.urlparse(location)
        query = urllib.parse.parse_qs(url.query)
        assert set(query) == {"Expires", "Signature", "Key-Pair-Id"}  # CloudFront's canned-policy names
        other = f"{cdn_at}/_cdn/{cdn([KIMI_K3, commit, 'config.json'])}?{url.query}"
        assert httpx2.get(other, headers=rng).status_code == 403  # the signature covers the file
        later = location.replace(f"Expires={query['Expires'][0]}", f"Expires={int(query['Expires'][0]) + 1000}")
        assert httpx2.get(later, headers=rng).status_code == 403  # ...and the expiry

        server.knobs.cdn_url_ttl_s = -10
        expired = httpx2.get(f"{server.url}/{KIMI_K3}/resolve/main/{name}", headers=auth).headers["location"]
        r = httpx2.get(expired, headers=rng)
        assert r.status_code == 403 and "Request has expired" in r.text
        server.knobs.cdn_url_ttl_s = 3600.0
        server.expire_cdn_urls()  # as if the clock had passed every Expires handed out so far
        r = httpx2.get(location, headers=rng)
        assert r.status_code == 403 and "Request has expired" in r.text
        fresh = httpx2.get(f"{server.url}/{KIMI_K3}/resolve/main/{name}", headers=auth).headers["location"]
        assert httpx2.get(fresh, headers=rng).status_code == 206

        key_id = server._cdn_key_id
        for token in (cdn([[], "x", "y"]), cdn({"a": 1}), cdn([KIMI_K3, commit]), "!!notbase64", "YWJj"):
            expires = str(int(time.time()) + 100)
            sig = server._cdn_mac(
                server._cdn_keys[key_id], token, expires
            )  # even a signed URL must decode to three strings
            signed = {"Expires": [expires], "Signature": [sig], "Key-Pair-Id": [key_id]}
            assert server.cdn_verify(token, signed) == "Access denied"
            if token[0] != "!":
                q = f"Expires={expires}&Signature={sig}&Key-Pair-Id={key_id}"
                assert httpx2.get(f"{cdn_at}/_cdn/{token}?{q}").status_code == 403
        for query in ({}, {"Expires": ["x"], "Signature": ["y"]}, {"Expires": ["1" * 40], "Signature": [""]}):
            assert (
                server.cdn_verify(cdn([KIMI_K3, commit, name]), {**query, "Key-Pair-Id": [key_id]}) == "Access denied"
            )

        # the real client: huggingface_hub resolves with the token, then follows the signed URL
        monkeypatch.setenv("HF_TOKEN", "hf_private")
        path = hf_hub_download(KIMI_K3, name, cache_dir=tmp_path / "dl", endpoint=server.url, token="hf_private")
        assert Path(path).read_bytes() == original
        with hub_client.using_endpoint(server.url):
            reader = hub_client.RangeReader()
            data = reader.read(hub_client.RemoteFile(KIMI_K3, commit, name), 100, 5000)
        assert data == original[100:5000]
