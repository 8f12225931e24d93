"""T5 encoder parity with HF `transformers.T5EncoderModel` (PyTorch); loaders; tokenizers."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsora.models import t5 as T5
from tests.conftest import rel_err

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Tiny T5 v1.1 layout: gated-GELU FF, relative buckets, 4 heads of 8.
HF_TINY = dict(
    vocab_size=300,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
)
L = 24


def _hf_model(cls, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.T5Config(**{**HF_TINY, **overrides})
    return cls(cfg).eval()


def _hf_forward(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    return out.last_hidden_state.numpy()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model = _hf_model(transformers.T5EncoderModel)
    d = tmp_path_factory.mktemp("t5_hf")
    model.save_pretrained(str(d))
    return str(d), model


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 300, size=(3, L)).astype(np.int32)
    mask = np.ones((3, L), np.int32)
    for i, n in enumerate([L, 15, 4]):  # full, half, short caption
        mask[i, n:] = 0
        ids[i, n:] = 0
        ids[i, n - 1] = 1  # EOS
    return ids, mask


def test_relative_position_buckets_match_hf():
    # Open-Sora's 300 tokens and beyond max_distance (128), both directions.
    for n, buckets, max_dist in [(300, 32, 128), (40, 8, 16)]:
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
            rel, bidirectional=True, num_buckets=buckets, max_distance=max_dist
        ).numpy()
        np.testing.assert_array_equal(T5.relative_position_bucket(n, n, buckets, max_dist), ref)


def test_encoder_matches_hf_fp32_with_padding(hf_folder, batch):
    folder, hf = hf_folder
    ids, mask = batch
    ref = _hf_forward(hf, ids, mask)
    ours = np.asarray(T5.load_t5_encoder(folder)(jnp.asarray(ids), jnp.asarray(mask)))
    assert ours.shape == (3, L, 32) and ours.dtype == np.float32
    valid, pad = mask.astype(bool), ~mask.astype(bool)
    assert rel_err(ours[valid], ref[valid]) < 1e-5
    assert rel_err(ours[pad], ref[pad]) < 1e-5  # padded queries still attend to valid keys, as in HF
    # Padding invariance: a caption's valid states do not depend on the padding length.
    short = np.asarray(T5.load_t5_encoder(folder)(jnp.asarray(ids[2:, :6]), jnp.asarray(mask[2:, :6])))
    assert rel_err(short[0, :4], ours[2, :4]) < 1e-5


def test_bf16_compute_close_to_fp32(hf_folder, batch):
    folder, _ = hf_folder
    ids, mask = batch
    m32 = T5.load_t5_encoder(folder)
    m16 = T5.load_t5_encoder(folder, jnp.bfloat16)
    assert m16.block[0].attn.q.weight[...].dtype == jnp.float32  # fp32 params, bf16 compute
    out16 = m16(jnp.asarray(ids), jnp.asarray(mask))
    assert out16.dtype == jnp.bfloat16
    assert rel_err(np.asarray(out16.astype(jnp.float32)), np.asarray(m32(ids, mask))) < 3e-2


def test_sharded_index_and_conditional_generation_folders(tmp_path, hf_folder, batch):
    _, hf = hf_folder
    ids, mask = batch
    ref = _hf_forward(hf, ids, mask)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert rel_err(np.asarray(T5.load_t5_encoder(str(sharded))(ids, mask)), ref) < 1e-5

    # A full encoder-decoder checkpoint: take the encoder and the shared embedding.
    full = _hf_model(transformers.T5ForConditionalGeneration, seed=1)
    full.save_pretrained(str(tmp_path / "full"))
    ref_full = _hf_forward(full.get_encoder(), ids, mask)
    assert rel_err(np.asarray(T5.load_t5_encoder(str(tmp_path / "full"))(ids, mask)), ref_full) < 1e-5


def test_original_t5_relu_variant(tmp_path, batch):
    ids, mask = batch
    hf = _hf_model(transformers.T5EncoderModel, seed=2, feed_forward_proj="relu")
    hf.save_pretrained(str(tmp_path))
    ours = np.asarray(T5.load_t5_encoder(str(tmp_path))(ids, mask))
    assert rel_err(ours, _hf_forward(hf, ids, mask)) < 1e-5


def test_load_errors_name_the_problem(tmp_path, hf_folder):
    folder, _ = hf_folder
    from safetensors.numpy import load_file, save_file

    with pytest.raises(FileNotFoundError, match="config.json"):
        T5.load_t5_encoder(str(tmp_path))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)

    def write(name, sd):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        if sd is not None:
            save_file(sd, str(d / "model.safetensors"))
        return str(d)

    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        T5.load_t5_encoder(write("noweights", None))
    key = "encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        T5.load_t5_encoder(write("missing", {k: v for k, v in sd.items() if k != key}))
    bad = dict(sd)
    bad["encoder.final_layer_norm.weight"] = np.ones(31, np.float32)
    with pytest.raises(ValueError, match=r"encoder\.final_layer_norm\.weight.*\(31,\)"):
        T5.load_t5_encoder(write("shape", bad))


def test_load_onto_mesh_shards_params(hf_folder, batch):
    folder, _ = hf_folder
    ids, mask = batch
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    rules = [("embed", "fsdp"), ("mlp", None), ("heads", None), ("vocab", None)]
    model = T5.load_t5_encoder(folder, mesh=mesh, rules=rules)
    w = model.block[0].ff.wi_0.weight[...]
    assert w.sharding.spec == jax.sharding.PartitionSpec("fsdp", None) and len(w.sharding.device_set) == 8
    ref = T5.load_t5_encoder(folder)(ids, mask)
    out = jax.jit(lambda m, i, k: m(i, k))(model, ids, mask)
    assert rel_err(np.asarray(out), np.asarray(ref)) < 1e-6
    # The host-side wrapper runs the sharded model as it is.
    enc = T5.TextEncoder(model, T5.ByteTokenizer(16))
    ids16, mask16 = enc.tokenize(["a red fox", "snow"])
    y, _ = enc.encode(["a red fox", "snow"])
    assert rel_err(y[:, 0], np.asarray(T5.load_t5_encoder(folder)(ids16, mask16))) < 1e-6


def _train_sentencepiece(folder):
    spm = pytest.importorskip("sentencepiece")
    corpus = [
        "a red fox jumps over the lazy dog",
        "the camera pans left over a city at night",
        "a woman walks on the beach at sunset",
        "slow motion water drops on a leaf",
        "aesthetic score: 5.5, motion score: 10, camera motion: pan left.",
    ] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_prefix=os.path.join(folder, "spiece"),
        vocab_size=40,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        character_coverage=1.0,
        minloglevel=2,
    )
    os.remove(os.path.join(folder, "spiece.vocab"))
    return spm.SentencePieceProcessor(model_file=os.path.join(folder, "spiece.model"))


def test_sentencepiece_tokenizer_and_text_encoder(tmp_path, hf_folder):
    _, hf = hf_folder
    d = tmp_path / "t5"
    hf.save_pretrained(str(d))
    sp = _train_sentencepiece(str(d))  # the folder now looks like DeepFloyd/t5-v1_1-xxl (spiece.model)
    texts = [
        "a red fox",
        "the camera pans left over a city at night, slowly and then faster",
        "zebra!",
        "",
    ]
    n = 12
    enc = T5.build_text_encoder({"kind": "t5", "path": str(d), "model_max_length": n, "dtype": "float32"})
    assert enc.caption_channels == 32 and enc.model_max_length == n
    ids, mask = enc.tokenize(texts)
    for i, t in enumerate(texts):  # raw SentencePiece, truncated to n − 1, then EOS, then pad
        want = sp.encode(t)[: n - 1] + [T5.EOS_ID]
        np.testing.assert_array_equal(ids[i], want + [T5.PAD_ID] * (n - len(want)))
        np.testing.assert_array_equal(mask[i], [1] * len(want) + [0] * (n - len(want)))
    y, m = enc.encode(texts)
    assert y.shape == (4, 1, n, 32) and y.dtype == np.float32 and m.dtype == np.int32
    np.testing.assert_array_equal(m, mask)
    assert rel_err(y[:, 0], _hf_forward(hf, ids, mask)) < 1e-5


def test_byte_tokenizer_matches_byt5():
    texts = ["a cat", "añ€ ünïcode", "x" * 40, ""]
    n = 16
    ids, mask = T5.ByteTokenizer(n)(texts)
    ref = transformers.ByT5Tokenizer()(
        texts,
        max_length=n,
        padding="max_length",
        truncation=True,
        return_attention_mask=True,
        return_tensors="np",
    )
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["attention_mask"])
    assert ids.dtype == np.int32 and mask.dtype == np.int32


def test_tiny_text_encoder_no_files():
    cfg = {
        "kind": "tiny",
        "d_model": 32,
        "num_layers": 2,
        "num_heads": 2,
        "d_ff": 64,
        "model_max_length": 32,
        "seed": 0,
    }
    enc = T5.build_text_encoder(cfg)
    texts = ["a red fox", "the camera pans", "snow"]
    y, mask = enc.encode(texts)
    assert y.shape == (3, 1, 32, 32) and mask.shape == (3, 32) and np.isfinite(y).all()
    np.testing.assert_array_equal(mask.sum(1), [len(t) + 1 for t in texts])
    # Per-caption result independent of the batch (batch padded to a power of two inside).
    y1, _ = enc.encode(texts[1:2])
    np.testing.assert_allclose(y1[0], y[1], rtol=1e-5, atol=1e-6)
    # Same seed → same weights.
    leaves = lambda c: [np.asarray(x) for x in jax.tree.leaves(T5.build_text_encoder(c).state)]
    assert all(np.array_equal(a, b) for a, b in zip(leaves(cfg), jax.tree.leaves(enc.state)))
    # another seed → different random weights: all 16 but the 5 all-ones norm scales
    assert sum(not np.array_equal(a, b) for a, b in zip(leaves({**cfg, "seed": 1}), jax.tree.leaves(enc.state))) == 16
    with pytest.raises(ValueError, match="kind"):
        T5.build_text_encoder({"kind": "clip"})
