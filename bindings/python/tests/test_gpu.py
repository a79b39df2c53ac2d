"""CUDA moves with real frameworks. Skipped, with the reason, where no usable GPU is present;
on a GPU machine `bash scripts/test.sh` runs them with everything else."""

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _native

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    try:
        _native.ensure_device("cuda:0")
    except tf.DeviceUnavailableError as e:
        pytest.skip(f"no usable CUDA device: {e}")
    return "cuda:0"


@pytest.fixture
def torch_cuda(cuda):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA support here")
    return torch


def test_a_torch_gpu_dict_comes_to_the_host_as_torch(torch_cuda):
    torch = torch_cuda
    src = {
        "w": torch.randn(64, 32, device="cuda"),
        "t": torch.randn(32, 64, device="cuda").t(),
        "b": torch.randn(7, device="cuda", dtype=torch.bfloat16),
        "step": 3,
        "tag": "x",
    }
    out = tf.to_host(src)
    for k in ("w", "t", "b"):
        assert out[k].device.type == "cpu" and out[k].dtype == src[k].dtype
        assert torch.equal(out[k], src[k].cpu())
    assert out["tag"] is src["tag"]


def _many_small(torch, device):
    """Groups of small tensors of one dtype and shape (stacked by the bulk paths; a
    transposed one among them), bfloat16 rows of 10 bytes (stacked to the host only), and
    odd ones out: a conjugate view, a lone shape, a plain value."""
    g = torch.Generator(device=device).manual_seed(0)
    src = {f"w{i}": torch.randn(16, 8, device=device, generator=g) for i in range(300)}
    src.update({f"b{i}": torch.arange(i, i + 16, device=device, dtype=torch.int32) for i in range(40)})
    src["t"] = torch.randn(8, 16, device=device, generator=g).t()
    src.update({f"h{i}": torch.randn(5, device=device, generator=g).to(torch.bfloat16) for i in range(3)})
    src["c"] = torch.randn(4, dtype=torch.complex64, device=device, generator=g).conj()
    src["lone"] = torch.randn(3, device=device, generator=g)
    src["tag"] = "x"
    return src


@pytest.mark.parametrize("pinned", [False, True])
def test_many_small_torch_gpu_tensors_come_to_the_host_with_their_values(torch_cuda, pinned):
    torch = torch_cuda
    src = _many_small(torch, "cuda")
    want = {k: v.resolve_conj().cpu() for k, v in src.items() if isinstance(v, torch.Tensor)}
    want["w0"] = want["w0"] * 3
    # Work still queued on PyTorch's current stream (a side stream, held by a sleep) when
    # the call starts must come first.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        src["w0"].mul_(3)
        out = tf.to_host(src, pinned=pinned)
    assert out["tag"] is src["tag"]
    for k, v in want.items():
        assert out[k].device.type == "cpu" and out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k], v), k
    # The groups came as stacks: rows of one buffer.
    assert out["w1"].untyped_storage().data_ptr() == out["w2"].untyped_storage().data_ptr()


def test_small_torch_tensors_on_a_gpu_other_than_the_current_one_come_to_the_host(torch_cuda):
    torch = torch_cuda
    if torch.cuda.device_count() < 2 or "cuda:1" not in tf.devices():
        pytest.skip("needs two GPUs")
    src = {f"a{i}": torch.full((256,), float(i), device="cuda:1") for i in range(50)}
    src.update({f"b{i}": torch.full((256,), -float(i), device="cuda:0") for i in range(50)})
    with torch.cuda.device(0):
        side = torch.cuda.Stream(device=1)
        side.wait_stream(torch.cuda.current_stream(1))
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            src["a0"].add_(7)
            out = tf.to_host(src)
    assert torch.equal(out["a0"], torch.full((256,), 7.0))
    for i in range(1, 50):
        assert torch.equal(out[f"a{i}"], torch.full((256,), float(i)))
        assert torch.equal(out[f"b{i}"], torch.full((256,), -float(i)))
    # One dtype and shape on two GPUs: a group (so a stack) per GPU, not none at all.
    for x in "ab":
        assert out[f"{x}1"].untyped_storage().data_ptr() == out[f"{x}2"].untyped_storage().data_ptr()


def test_many_small_torch_cpu_tensors_go_to_the_gpu_with_their_values(torch_cuda):
    torch = torch_cuda
    src = _many_small(torch, "cpu")
    out = tf.to_device(src, "cuda:0")
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            assert out[k].is_cuda and out[k].dtype == v.dtype and out[k].shape == v.shape, k
            assert torch.equal(out[k].cpu(), v.resolve_conj()), k
            assert out[k].data_ptr() % 64 == 0, k  # as the engine places every tensor
    assert out["w1"].untyped_storage().data_ptr() == out["w2"].untyped_storage().data_ptr()
    back = tf.to_numpy({"w1": out["w1"], "b3": out["b3"]})
    np.testing.assert_array_equal(back["w1"], src["w1"].numpy())
    np.testing.assert_array_equal(back["b3"], src["b3"].numpy())


def test_non_blocking_results_are_read_only_after_the_copy(torch_cuda):
    torch = torch_cuda
    src = {f"t{i}": torch.full((1024,), float(i), device="cuda") for i in range(100)}
    pending = tf.to_host(src, non_blocking=True)
    # PyTorch tensors cannot wait for a copy by themselves: they come through a Transfer,
    # which gives the structure only once the copies have finished.
    assert isinstance(pending, tf.Transfer)
    out = pending.result()
    for i in range(100):
        assert out[f"t{i}"][0].item() == float(i)


def test_numpy_goes_to_the_gpu_and_back(cuda):
    src = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": [[1, 2], [3, 4]]}
    there = tf.to_device(src, cuda)
    assert there["a"].device == cuda and there["ids"].dtype == "int64"
    back = tf.to_numpy(there)
    np.testing.assert_array_equal(back["a"], src["a"])
    np.testing.assert_array_equal(back["ids"], [[1, 2], [3, 4]])


def test_torch_cpu_tensors_go_to_the_gpu_as_torch(torch_cuda):
    torch = torch_cuda
    src = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    out = tf.to_device(src, "cuda:0")
    assert isinstance(out["w"], torch.Tensor) and out["w"].is_cuda
    assert torch.equal(out["w"].cpu(), src["w"])


def test_cupy_arrays_come_to_the_host_as_numpy(cuda):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    src = {"x": cupy.arange(10, dtype=cupy.float32)}
    out = tf.to_host(src)
    assert isinstance(out["x"], np.ndarray)
    np.testing.assert_array_equal(out["x"], np.arange(10, dtype=np.float32))


def test_a_large_dictionary_round_trips_through_the_staging_ring(cuda):
    src = {f"layer{i}": np.random.default_rng(i).standard_normal((300, 257), np.float32) for i in range(40)}
    src["ids"] = np.arange(1001, dtype=np.int64)[::3]  # strided
    for staging in ("on", "off", (1 << 16, 2)):
        there = tf.to_device(src, cuda, staging=staging, non_blocking=True).result()
        back = tf.to_numpy(tf.to_host(there, staging=staging, non_blocking=True).result())
        for k, v in src.items():
            np.testing.assert_array_equal(back[k], v)


def test_a_repeated_pinned_transfer_pins_nothing_new_on_the_gpu(cuda):
    src = tf.to_device({f"t{i}": np.full((4096,), i, np.float32) for i in range(32)}, cuda)
    tf.to_host(src, pinned=True)
    before = tf.pinned_pool_stats(cuda)
    out = tf.to_numpy(tf.to_host(src, pinned=True))
    after = tf.pinned_pool_stats(cuda)
    assert after["misses"] == before["misses"] and after["pinned_bytes"] == before["pinned_bytes"]
    assert after["hits"] > before["hits"]
    np.testing.assert_array_equal(out["t7"], np.full((4096,), 7, np.float32))


def test_a_gpu_dictionary_saves_and_loads(cuda, tmp_path):
    src = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": 7, "nested": {"b": np.ones(5, np.int64)}}
    there = tf.to_device(src, cuda, non_blocking=True).result()
    tf.save(there, tmp_path / "ckpt.safetensors")
    back = tf.load(tmp_path / "ckpt.safetensors", like="numpy")
    np.testing.assert_array_equal(back["w"], src["w"])
    np.testing.assert_array_equal(back["nested"]["b"], src["nested"]["b"])
    assert back["step"] == 7
    on_gpu = tf.load(tmp_path / "ckpt.safetensors", device=cuda)
    assert on_gpu["w"].device == cuda
    np.testing.assert_array_equal(on_gpu["w"].numpy(), src["w"])


def test_a_torch_gpu_state_dict_streams_into_the_file_after_torchs_own_kernels(torch_cuda, tmp_path):
    """The save streams CUDA tensors through a small ring (many chunks) and reads them after
    the kernels torch queued on its stream just before (no synchronize by the user)."""
    torch = torch_cuda
    state = {"w": torch.randn(4096, 1024, device="cuda"), "b": torch.arange(1000, device="cuda"), "step": 3}
    state["w"].mul_(3).add_(1)                      # queued on torch's stream, maybe still running
    tf.save(state, tmp_path / "m.safetensors", staging=(1 << 20, 2))
    back = tf.load(tmp_path / "m.safetensors")
    assert type(back["w"]) is torch.Tensor and back["step"] == 3
    assert torch.equal(back["w"], state["w"].cpu()) and torch.equal(back["b"], state["b"].cpu())


class _TorchLikeStream:
    """A producer stream as PyTorch shapes it (``cuda_stream``, ``device.index``) that
    counts host synchronisations."""

    def __init__(self, handle, index):
        import types

        self.cuda_stream = handle
        self.device = types.SimpleNamespace(index=index)
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_a_producer_stream_of_the_tensors_gpu_is_waited_for_on_the_gpu_not_by_the_caller(cuda):
    src = {"w": np.arange(1000.0)}
    x = tf.to_device(src, cuda)
    s = _TorchLikeStream(0, 0)  # the default stream of cuda:0
    out = tf.to_host(x, stream=s)
    assert s.synchronized == 0, "ordered on the GPU, not by a host wait"
    np.testing.assert_array_equal(tf.to_numpy(out)["w"], src["w"])
    # Host memory beside: host threads read it, so the caller waits for the stream.
    tf.to_host({**x, "h": np.ones(3)}, stream=s, copy=True)
    assert s.synchronized == 1
    # A stream of another GPU than the tensors': the caller waits too.
    other = _TorchLikeStream(0, 1)
    tf.to_host(x, stream=other)
    assert other.synchronized == 1


def test_stream_orders_the_download_after_torch_work_queued_on_that_stream(torch_cuda):
    """Work on a side stream of PyTorch's (not its current stream, which the DLPack import
    orders by itself): ``stream=`` makes the download wait for it on the GPU."""
    torch = torch_cuda
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # keeps the side stream busy for a while
        x.fill_(3.0)
    out = tf.to_host({"x": x}, stream=side)
    assert torch.equal(out["x"], torch.full((1 << 22,), 3.0))


class _RecordingProducer:
    """A DLPack producer of CUDA memory that records the stream its consumer passes."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.streams = []

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return self.tensor.__dlpack__(stream=stream, max_version=max_version)


def test_cuda_producers_are_given_the_stream_the_copies_run_on(cuda):
    data = np.arange(10, dtype=np.float32)
    producer = _RecordingProducer(tf.to_device({"x": data}, cuda)["x"])
    out = tf.to_numpy(tf.to_host({"x": producer}))
    np.testing.assert_array_equal(out["x"], data)
    (stream,) = producer.streams
    # DLPack: an int naming a CUDA stream; 0 is not allowed, 1 and 2 are default streams.
    assert isinstance(stream, int) and stream > 2


def test_transposed_arrays_round_trip_through_the_gpu(cuda):
    m = np.arange(300 * 200, dtype=np.float32).reshape(300, 200)
    src = {"t": m.T, "rows": m[::2], "col": m[:, 7]}
    back = tf.to_numpy(tf.to_host(tf.to_device(src, cuda, non_blocking=True).result(), non_blocking=True).result())
    for k, v in src.items():
        np.testing.assert_array_equal(back[k], v)


def test_non_blocking_to_host_of_torch_gpu_tensors_is_a_transfer(torch_cuda):
    torch = torch_cuda
    src = {"w": torch.randn(4096, 1024, device="cuda"), "b": torch.randn(7, device="cuda"), "step": 3}
    expected = {k: v.cpu() for k, v in src.items() if torch.is_tensor(v)}
    pending = tf.to_host(src, non_blocking=True, pinned=True)
    assert isinstance(pending, tf.Transfer)
    out = pending.result()
    assert out["step"] == 3 and pending.done()
    for k, v in expected.items():
        assert out[k].device.type == "cpu" and torch.equal(out[k], v)


def test_non_blocking_upload_into_torch_orders_torchs_stream_instead_of_waiting(torch_cuda):
    torch = torch_cuda
    # 256 MB of pinned memory: copied straight from it, on the GPU's stream. (From pageable
    # memory this size goes through the staging ring, whose last chunk is queued by a host
    # thread: PyTorch's stream can only be ordered after it once it is queued, and the
    # call waits for the copies on the host instead.)
    src = {f"w{i}": torch.randn(8 << 20).pin_memory() for i in range(8)}
    torch.cuda.synchronize()
    out = tf.to_device(src, "cuda:0", non_blocking=True).result()
    # Returned before the copies finished, even through .result(): PyTorch's stream waits
    # for them on the GPU (a blocking call, or one that waited on the host, leaves nothing
    # pending on it).
    pending = not torch.cuda.current_stream().query()
    for k, v in src.items():
        assert out[k].is_cuda and torch.equal(out[k].cpu(), v)
    assert pending, "the call waited for the copies on the host"


def test_dlpack_consumer_streams_are_checked(cuda):
    t = tf.to_device({"x": np.arange(6.0)}, cuda)["x"]
    assert t.__dlpack__(stream=1) is not None and t.__dlpack__(stream=-1) is not None
    with pytest.raises(BufferError, match="ambiguous"):
        t.__dlpack__(stream=0)
    with pytest.raises(TypeError, match="integer"):
        t.__dlpack__(stream="default")


@pytest.mark.parametrize("stream", [1, 2])
def test_default_stream_handles_are_waited_for_in_each_gpus_context(cuda, stream):
    """The handles 1 and 2 name the default stream of the context they are used in: with
    tensors on several GPUs (or none), the caller waits for each GPU's (GPU 0's), with
    that GPU's context current, never with no context (which the driver refuses)."""
    src = {"a": np.arange(4.0)}
    there = {d: tf.to_device(src, d)["a"] for d in tf.devices() if d.startswith("cuda")}
    out = tf.to_host(there, stream=stream)
    assert set(out) == set(there)
    for v in out.values():
        np.testing.assert_array_equal(v, src["a"])
    np.testing.assert_array_equal(tf.to_host(src, stream=stream, copy=True)["a"], src["a"])


def test_memory_named_without_a_stream_is_read_after_the_legacy_default_stream(torch_cuda):
    """A CUDA Array Interface producer that names no stream (Numba's default-stream arrays)
    may still have work queued on the legacy default stream; tensorferry's streams are
    non-blocking, so its copies wait for that stream explicitly, on the GPU."""
    torch = torch_cuda
    x = torch.zeros(1 << 20, device="cuda:0")
    torch.cuda.synchronize()

    class NoStream:
        def __init__(self, owner):
            self.owner = owner

        @property
        def __cuda_array_interface__(self):  # looked up on the type, as the protocol is
            return {**self.owner.__cuda_array_interface__, "stream": None}

    with torch.cuda.stream(torch.cuda.default_stream()):
        torch.cuda._sleep(200_000_000)  # the legacy default stream stays busy a while
        x.fill_(7.0)  # queued behind the sleep
        out = tf.to_host({"p": NoStream(x)})["p"]
    assert (np.asarray(out) == 7.0).all()


def test_a_non_blocking_download_does_not_hold_pytorchs_default_stream(torch_cuda):
    """tensorferry's streams are non-blocking: a kernel PyTorch queues on its default
    (legacy) stream after a non-blocking move runs at once, not after the move's copies."""
    import time

    torch = torch_cuda
    big = {"x": torch.empty(512 << 20, dtype=torch.uint8, device="cuda:0")}
    torch.ones(16, device="cuda:0").add_(1)  # the kernels below loaded once, untimed
    tf.to_host({"w": torch.ones(4, device="cuda:0")}, pinned=True)  # the pool warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    pending = tf.to_host(big, non_blocking=True, pinned=True)  # one batch, queued at once
    y = torch.ones(16, device="cuda:0")
    y.add_(1)
    mark = torch.cuda.Event()
    mark.record()
    mark.synchronize()
    kernel = time.perf_counter() - start
    pending.result()
    total = time.perf_counter() - start
    assert kernel < total / 4, f"the default stream waited for the download ({kernel:.4f} of {total:.4f} s)"
