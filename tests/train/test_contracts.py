"""Every implementation the training code is given holds to its contract (`jaxsora.train.contracts`):
the video and feature loaders and the tests' fake loader are `Loader`s, both VAEs are `VAE`s, the
tiny encoder is a `TextEncoder` — and something lacking a member is not."""
from flax import nnx

from jaxsora.data.features import FeatureLoader
from jaxsora.data.loader import VideoLoader
from jaxsora.models import vae as vae_lib
from jaxsora.models.t5 import build_text_encoder
from jaxsora.train.contracts import VAE, Loader, TextEncoder
from tests.train.fake_loader import FakeLoader


def test_loaders():
    for cls in (VideoLoader, FeatureLoader, FakeLoader):
        missing = [m for m in ("steps_per_epoch", "describe_plan", "state", "restore", "__iter__", "num_rows")
                   if not hasattr(cls, m)]
        assert not missing, (cls, missing)
    assert isinstance(FakeLoader(), Loader)
    assert not isinstance(object(), Loader)


def test_vaes_and_text_encoder():
    assert isinstance(vae_lib.IdentityVAE((1, 2, 2)), VAE)
    tiny = vae_lib.abstract_model(lambda: vae_lib.OpenSoraVAE(vae_lib.get_vae_config("OpenSoraVAE_V1_2"),
                                                              rngs=nnx.Rngs(0)))
    assert isinstance(tiny, VAE)
    te = build_text_encoder({"kind": "tiny", "d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32})
    assert isinstance(te, TextEncoder)
    assert not isinstance(vae_lib.IdentityVAE(), TextEncoder)
